"""`fabric-lin evaluate --tasks` where a task has fewer few-shot examples than are asked for (`fabric_lin.evaluate`'s
few_shot_shortfall), for a task that takes its examples from the split it is evaluated on: the harness leaves the
document asked about out of them, so a task of 4 documents has 3. The reference is the harness itself: 3 examples
run, 4 fail. Needs the optional extra (`pip install -e '.[eval]'`), skipped without it."""
import pytest

from test_evaluate_harness import evaluate_in_subprocess, run, write_tasks  # noqa: F401 - run: the fixture of a trained model

pytestmark = pytest.mark.slow


def test_a_task_s_own_num_fewshot_beyond_its_examples_of_the_split_it_is_evaluated_on_is_one_line(run, tmp_path):
    pytest.importorskip("lm_eval")
    write_tasks(tmp_path, n_docs=4)
    (tmp_path / "tasks" / "tiny_own_shots.yaml").write_text(
        f"task: tiny_own_shots\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n"
        "test_split: test\nfewshot_split: test\nnum_fewshot: 4\nmetadata: {version: 1.0}\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\nmetric_list: [{metric: acc}]\n')
    proc = evaluate_in_subprocess(run, tmp_path, "--max_batches", "0", "--tasks", "tiny_own_shots")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.endswith("fabric-lin evaluate: error: task tiny_own_shots asks for 4 few-shot examples (its "
                                "num_fewshot) and has 3: give --num_fewshot 3 or fewer\n"), proc.stderr[-3000:]
    proc = evaluate_in_subprocess(run, tmp_path, "--max_batches", "0", "--tasks", "tiny_own_shots", "--num_fewshot", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
