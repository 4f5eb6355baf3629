"""Stdlib-only helpers shared by the peer workers of bench/vs_peers.py (each worker runs in its own
venv, so nothing here may import a third-party package at module level).

Protocol: the orchestrator writes a spec JSON and runs `python <worker>.py SPEC OUT`; the worker
writes a result JSON to OUT. Spec keys: `prompts` (user messages), `prompt_token_ids` (the
chat-templated prompts, tokenized once by the orchestrator: every peer gets these exact ids),
`num_requests` (list of run sizes, each the first n prompts), `max_tokens`, `threads`, plus
worker-specific keys. Result: `runs` (one entry per run), `versions`, `settings`, `excluded`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def load_spec(argv=None) -> tuple[dict, str]:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} SPEC.json OUT.json")
    with open(argv[0]) as f:
        return json.load(f), argv[1]


def write_result(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def versions(*names: str) -> dict:
    out = {"python": sys.version.split()[0]}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def tree_cpu_seconds(root: int | None = None) -> float:
    """User + system CPU seconds of process `root` (default: this one) and all its live descendants,
    from /proc (vLLM computes in child processes)."""
    root = os.getpid() if root is None else root
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1] = ppid
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0.0)
        stack.extend(children.get(pid, []))
    return total


class Window:
    """Measures one timed window: wall seconds, the CPU seconds of this process and its descendants,
    the whole machine's CPU busy fraction (all processes, ours included) and the 1-minute load
    average at both ends. `cpu_share` = our CPU seconds / (wall seconds x cores): how much of the
    machine we got (or took)."""

    def __enter__(self):
        self.load_before = os.getloadavg()[0]
        self.ticks = _cpu_ticks()
        self.cpu = tree_cpu_seconds()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall_s = time.perf_counter() - self.t0
        self.process_cpu_s = tree_cpu_seconds() - self.cpu
        busy, total = _cpu_ticks()
        self.machine_busy = (busy - self.ticks[0]) / max(total - self.ticks[1], 1)
        self.load_after = os.getloadavg()[0]
        return False

    def record(self) -> dict:
        return {"wall_s": self.wall_s, "process_cpu_s": self.process_cpu_s,
                "cpu_share": round(self.process_cpu_s / (self.wall_s * (os.cpu_count() or 1)), 3),
                "machine_cpu_busy_fraction": round(self.machine_busy, 3),
                "loadavg_1m_before": self.load_before, "loadavg_1m_after": self.load_after}


def run_record(n: int, token_ids: list[list[int]], elapsed_s: float, window: Window, **extra) -> dict:
    num_tokens = sum(len(t) for t in token_ids)
    return {"num_requests": n, "output_tokens": num_tokens, "elapsed_s": elapsed_s,
            "tokens_per_s": num_tokens / elapsed_s,
            "tokens_per_cpu_s": num_tokens / window.process_cpu_s if window.process_cpu_s else None, **window.record(), **extra,
            "output_token_ids": token_ids}


@contextlib.contextmanager
def serving(cmd: list[str], port: int, log_path: str, env: dict | None = None, cwd: str | None = None,
            startup_timeout: float = 1800):
    """Starts the HTTP server `cmd`, which listens on 127.0.0.1:`port` (see `free_port`), in its own
    process group, its output to `log_path`; waits until GET /health answers 200; yields (base URL,
    start-up seconds, its process group id: see `paused`); stops it (SIGTERM, then SIGKILL after 60 s)."""
    start = time.perf_counter()
    with open(log_path, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, **(env or {})},
                                   start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {process.returncode}: see {log_path}")
            with contextlib.suppress(OSError):  # refused, or 503 while loading
                urllib.request.urlopen(base + "/health", timeout=5).read()
                break
            if time.perf_counter() - start > startup_timeout:
                raise TimeoutError(f"{cmd[0]} did not answer /health in {startup_timeout:.0f}s: see {log_path}")
            time.sleep(0.25)
        yield base, time.perf_counter() - start, process.pid
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@contextlib.contextmanager
def paused(group: int):
    """Stops the process group `group` (a server of `serving`) for the block, SIGSTOP to SIGCONT: a peer
    measured beside another server takes no CPU from it, even where its threads would spin while idle
    (llama.cpp's OpenMP threads under OMP_WAIT_POLICY=active spin long after their last work)."""
    os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(group, signal.SIGCONT)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# llama.cpp's OpenMP threads spin-wait at barriers by default (OMP_WAIT_POLICY=active), as it ships
# and as the peers run it: on a quiet machine that is its fast setting (one stream, AMD EPYC, 2 cores,
# quiet: F32 14.4 ms/token active against 31.7 passive). On a shared 2-core machine a descheduled
# spinner stalls every step instead (load average 5-6: 165-330 ms/token active, 41-95 passive): pass
# passive there (`--llama-omp-wait-policy passive`), and say so with the figures.
LLAMA_OMP_WAIT_POLICY = "active"


def llama_server_command(llama_cpp_dir: str, gguf: str, port: int, slots: int, ctx_per_slot: int, threads: int,
                         alias: str = "smol") -> list[str]:
    """llama-server of the build in `llama_cpp_dir` (bench/peers/build_llama_cpp.sh) on `gguf`: `slots`
    slots of `ctx_per_slot` tokens each (-c is their sum), `threads` threads for decode and prompt
    batches, prompt caching off on both levels (the slot's own KV and the host RAM cache: jpaged's
    prefix caching is off too), the KV cache and attention at llama.cpp's defaults (f16, flash
    attention 'auto'), no web UI."""
    return [os.path.join(llama_cpp_dir, "build", "bin", "llama-server"), "-m", gguf, "--host", "127.0.0.1",
            "--port", str(port), "--alias", alias, "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "-c", str(slots * ctx_per_slot), "--no-cache-prompt", "--cache-ram", "0", "--no-webui"]


def llama_build_info(llama_cpp_dir: str) -> str | None:
    """The build's `llama-server --version` and CPU feature lines (build_info.txt), or None."""
    path = os.path.join(llama_cpp_dir, "build_info.txt")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read()


def log(*args) -> None:
    print(f"[{os.path.basename(sys.argv[0])} {time.strftime('%H:%M:%S')}]", *args, file=sys.stderr, flush=True)
