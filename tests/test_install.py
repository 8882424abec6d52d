"""The installed package wins over a directory named ``fuser`` beside the user's script (a clone of this repository,
which without the ``src/`` layout Python imported as an empty namespace package: ``module 'fuser' has no attribute
'optimize_'``)."""

import subprocess
import sys


def test_a_fuser_directory_beside_the_script_does_not_shadow_the_installed_package(tmp_path):
    (tmp_path / "fuser" / "benchmarks").mkdir(parents=True)  # what a clone looks like from its parent directory
    (tmp_path / "fuser" / "README.md").write_text("a clone\n")
    script = "import fuser; print(callable(fuser.optimize_), callable(fuser.optimize))"
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True True"
