"""fabric_lin/data/sample_order.py's order itself, position by position, without data: which sample of its source a
position holds, the mixing groups and their shares, the windows of chunk files each epoch reads and whose draws they
are, what a second change of order carries each source on from. (The stream over prepared directories, on any layout
and resumed: test_data_modules.py.)"""
import numpy as np

from fabric_lin.data.sample_order import WINDOW_CHUNKS, MixOrder, SourceOrder, carried_after


def test_a_second_new_order_carries_each_source_on_from_where_the_first_left_it():
    """Sources carried into a stream at their 100th and 50th samples (an earlier --resume_changes data) have given
    that many more than the stream took from them: a mixing group of 1,024 positions at 3 : 1 takes 768 and 256."""
    order = {"weights": [3.0, 1.0], "seed": 7, "sources": ["a", "b"]}
    assert carried_after(order, [(42, 0, 100), (42, 1, 50)], 1024) == {"a": (42, 0, 868), "b": (42, 1, 306)}


def test_a_position_holds_the_next_sample_of_its_source_across_mixing_groups():
    """Position p holds source s's k-th sample, k the number of earlier positions of s, which given_before(p) counts
    (what a new order carries each source on from); another seed places the sources otherwise."""
    mix = MixOrder([0.7, 0.3], seed=5)
    counted = [0, 0]
    for position in range(2 * mix.group + 10):
        assert mix.given_before(position).tolist() == counted
        source, k = mix.sample(position)
        assert k == counted[source]
        counted[source] += 1
    assert MixOrder([0.7, 0.3], seed=6).group_places(0)[0].tolist() != mix.group_places(0)[0].tolist()
    # each group otherwise, also where two groups give each source as many places (not one pattern over and over)
    halves = MixOrder([1.0, 1.0], seed=5)
    assert halves.group_places(1)[0].tolist() != halves.group_places(0)[0].tolist()


def test_a_source_of_tiny_weight_among_many_gets_samples_in_every_mixing_group():
    """7 sources of weight 1 and one of 0.0072: in groups of 1,024 positions the others' rounding would take more
    than its share (fewer than no samples); the groups are made large enough for it."""
    mix = MixOrder([1] * 7 + [0.0072], seed=0)
    for group in range(30):
        assert (mix.given_before((group + 1) * mix.group) - mix.given_before(group * mix.group) >= 1).all(), group


def test_each_epoch_reads_windows_of_other_chunk_files_their_blocks_shuffled():
    """40 chunk files of 10 blocks: each epoch reads every block once; its first window of 16 files holds other files
    in each epoch; and a window's blocks come shuffled, not file after file, so a micro batch mixes many files."""
    order = SourceOrder(np.full(40, 10), seed=3, source=0, shuffle=True)
    epochs = [[order.block(epoch * 400 + i) for i in range(400)] for epoch in range(2)]
    assert all(sorted(blocks) == list(range(400)) for blocks in epochs)
    first_windows = [{block // 10 for block in blocks[: WINDOW_CHUNKS * 10]} for blocks in epochs]
    assert [len(files) for files in first_windows] == [WINDOW_CHUNKS] * 2 and first_windows[0] != first_windows[1]
    assert all(len({block // 10 for block in blocks[:16]}) >= 8 for blocks in epochs)

def test_each_source_and_each_window_draws_an_order_of_its_own():
    """Two sources of the same shape (as two directories prepared alike are) read their files and blocks in other
    orders, not in step; and no two windows of as many blocks, of one source or two, are shuffled in one pattern."""
    sizes = np.full(40, 10)
    a, b = (SourceOrder(sizes, seed=3, source=source, shuffle=True) for source in (0, 1))
    assert a.chunk_order(0).tolist() != b.chunk_order(0).tolist()
    assert [a.block(k) for k in range(400)] != [b.block(k) for k in range(400)]
    slots = []  # of each block of a window, the place of its file among the window's 16 files
    for order, window in ((a, 0), (a, 1), (b, 0)):
        files = order.chunk_order(0)[window * WINDOW_CHUNKS : (window + 1) * WINDOW_CHUNKS].tolist()
        slots.append(tuple(files.index(block // 10) for block in order.window_blocks(0, window)))
    assert len(set(slots)) == 3


def test_a_mixing_group_gives_each_source_its_share_rounded_down_and_the_last_the_rest():
    """The sample order is part of what a checkpoint's position means: how many samples each source gave before a
    group (shares rounded down, carried from group to group) cannot change without moving every position."""
    import math

    mix = MixOrder([0.693584, 0.306416], seed=0)
    for group in range(8):
        n = group * 1024
        assert mix.given_before_group(group).tolist() == [math.floor(n * 0.693584), n - math.floor(n * 0.693584)], group


def test_every_epoch_of_chunk_files_of_unequal_sizes_reads_each_block_once_in_a_new_order():
    """Chunk files of unequal numbers of blocks (as real data's are, its last one cut short) in three windows: every
    epoch reads each block once, though each epoch's windows start at other places; a source of one window (16 files
    or fewer) is read in a new order each epoch too; unshuffled, in the index's order every epoch."""
    sizes = np.array([3, 1, 4, 1, 5, 9, 2, 6] * 5)  # 40 files, 155 blocks
    order = SourceOrder(sizes, seed=3, source=0, shuffle=True)
    for epoch in range(3):
        assert sorted(order.block(epoch * 155 + i) for i in range(155)) == list(range(155)), epoch
    small = SourceOrder(np.array([5, 3, 7]), seed=3, source=0, shuffle=True)
    epochs = [[small.block(epoch * 15 + i) for i in range(15)] for epoch in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(15)) and epochs[0] != epochs[1]
    in_order = SourceOrder(sizes, seed=3, source=0, shuffle=False)
    assert [in_order.block(k) for k in range(2 * 155)] == list(range(155)) * 2
