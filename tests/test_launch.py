"""The kernel wrappers' shared launch arithmetic (fabric_lin/ops/launch.py) against Triton's own helpers."""


def test_launch_arithmetic_matches_triton():
    # the wrappers' plain-Python grid arithmetic gives what Triton's own helpers give
    import triton

    from fabric_lin.ops.launch import cdiv, next_power_of_2

    assert [next_power_of_2(n) for n in range(1, 5000)] == [triton.next_power_of_2(n) for n in range(1, 5000)]
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 300) for b in range(1, 70))
