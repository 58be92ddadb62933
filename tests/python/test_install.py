"""`cmake --install` puts an importable package in the site-packages layout under the prefix."""
import os
import subprocess
import sys
import sysconfig

import pytest

import mha

BUILD = os.environ.get("MHA_BUILD_DIR")


@pytest.mark.skipif(not BUILD, reason="MHA_BUILD_DIR not set (ctest sets it)")
def test_cmake_install_layout(tmp_path):
    prefix = tmp_path / "prefix"
    subprocess.run(["cmake", "--install", BUILD, "--prefix", str(prefix)], check=True, capture_output=True)
    site = sysconfig.get_path("platlib", "posix_prefix", vars={"platbase": str(prefix), "base": str(prefix)})
    assert os.path.isfile(os.path.join(site, "mha", "__init__.py")), os.listdir(prefix)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = site
    code = ("import mha, numpy as np; q = np.ones((1, 1, 2, 4), np.float32); "
            "print(mha.__file__, mha.__version__, float(mha.sdpa(q, q, q).sum()))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    path, version, total = r.stdout.split()
    assert path.startswith(str(prefix)) and version == mha.__version__ and float(total) == 8.0
