"""What the tests that run workers in processes of their own share (the sharding workers: forced CPU
devices act only before JAX starts, and this suite runs on one): JAX's persistent compilation cache,
and starting workers that print one JSON line, bounded in time.

Compilation cache: `<repo>/.jax_cache` (git-ignored), so a rerun loads the step executables instead of
compiling them again; `JPAGED_JAX_CACHE=0` turns it off, any other value names another directory.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def enable_compilation_cache() -> None:
    from jpaged.entrypoints.cli import enable_compile_cache

    setting = os.environ.get("JPAGED_JAX_CACHE", "")
    if setting != "0":
        enable_compile_cache(setting or str(REPO_ROOT / ".jax_cache"))


def worker_env(num_devices: int) -> dict:
    """The environment of a worker process: `num_devices` forced CPU devices, the repository importable."""
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={num_devices}",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


def run_workers(argvs: list[list[str]], env: dict, timeout: float) -> list[dict]:
    """Starts `python ARGV` for each of `argvs` at once and returns the JSON object each printed last.
    Output goes to files, not pipes (a process blocked on a full pipe would leave another waiting in a
    collective); all of them are killed past `timeout` seconds, so a hang never stalls the suite."""
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in argvs]
    procs = [subprocess.Popen([sys.executable, *argv], stdout=out, stderr=err, text=True, env=env)
             for argv, (out, err) in zip(argvs, logs)]
    deadline, results = time.monotonic() + timeout, []
    try:
        for proc, (out, err) in zip(procs, logs):
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            out.seek(0), err.seek(0)
            assert proc.returncode == 0, err.read()[-4000:]
            results.append(json.loads(out.read().strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for files in logs:
            for f in files:
                f.close()
    return results
