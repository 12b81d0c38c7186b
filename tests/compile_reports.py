"""The sm_90 compile reports of benchmarks/kernel_registers.py and gdn_kernel_registers.py for a test module, all of
its reports in one process (torch's and Triton's import, ~3 s, paid once), which this file is as a script:

    python tests/compile_reports.py gdn_kernel_registers '{"name": ["--shapes", "2,256,2,48,100"], ...}'

prints {name: the script's report for those options} as one JSON document. The process runs without Triton's
interpreter, which the pytest process has on a machine without a GPU.
"""
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]


def compile_reports(script: str, options: Dict[str, List[str]], timeout: float = 900) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__, script, json.dumps(options)], capture_output=True, text=True,
                            env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = json.loads(result.stdout)
    assert sorted(reports) == sorted(options), result.stdout[-3000:]
    return reports


if __name__ == "__main__":
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    report_script = importlib.import_module(sys.argv[1])
    reports = {name: report_script.build_report(report_script.arguments().parse_args(argv))
               for name, argv in json.loads(sys.argv[2]).items()}
    print(json.dumps(reports))
