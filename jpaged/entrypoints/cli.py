"""The `jpaged` command: `generate`, `serve`, `convert`.

`jpaged generate`: one prompt streams its text as it is produced; several print each completion in
input order; `--json` prints one JSON object per request and a final `{"summary": ...}` line. The
summary goes to stderr otherwise. `jpaged serve`: the OpenAI API over HTTP (`server.py`).
`jpaged serve` first compiles every step shape its limits allow (the warm-up, with progress on
stderr and its time printed; `--no-warm-up` skips it), so that no request waits for a compilation.
`jpaged convert`: a model as a jpaged checkpoint. `jpaged generate --coordinator-address HOST:PORT
--num-processes N --process-id I`: one of N processes of one engine (`jpaged.device.distributed`);
process 0 reads the prompts and prints, the others print nothing; each says on stderr that it waits
for the others, and ends with one line past `--join-timeout`. `jpaged serve` takes the same flags:
process 0 serves HTTP and hands each step's requests to the others (`jpaged.engine.lockstep`), which
say in one line that they follow it; a process that goes away ends the others, each with one
`error: ...` line and exit status 1 (process 0 answering its open requests with the error first).
`--seed S` gives prompt i the seed S + i*n (`--same-seed`: S for all). Bad input (a malformed option too, without the usage): a
one-line `error: ...` on stderr and exit status 2, before anything loads; a request that failed in
a step: its error on stderr and exit status 1.

Compilation cache: `generate` and `serve` turn on JAX's persistent compilation cache in
`default_compile_cache_dir()` (`$XDG_CACHE_HOME/jpaged/xla`, else `~/.cache/jpaged/xla`), so a second
start loads its executables instead of compiling them; `--compile-cache DIR` puts it elsewhere,
`--compile-cache none` turns it off. A cache directory JAX was already given (`JAX_COMPILATION_CACHE_DIR`)
is kept unless `--compile-cache` names one. The Python API (`LLM`) leaves JAX's configuration alone:
call `enable_compile_cache()` for the same cache there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from typing import Optional


def default_compile_cache_dir() -> str:
    """Where jpaged keeps JAX's persistent compilation cache by default: `$XDG_CACHE_HOME/jpaged/xla`,
    else `~/.cache/jpaged/xla`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jpaged", "xla")


def enable_compile_cache(path: Optional[str] = None, *, min_compile_seconds: float = 0.5) -> Optional[str]:
    """Turns on JAX's persistent compilation cache in `path` (default: `default_compile_cache_dir()`)
    for executables that took at least `min_compile_seconds` to compile (every step does; a rerun then
    loads them instead of compiling); `path="none"` turns it off. A global JAX setting: call it before
    anything compiles. Returns the directory, or None when off."""
    import jax

    if path == "none":
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    path = path or default_compile_cache_dir()
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def use_compile_cache(args) -> Optional[str]:
    """`--compile-cache` applied: DIR or 'none' as given; when not given, the default directory unless JAX
    was given a cache directory already. Returns the directory in use (None: no cache)."""
    import jax

    if args.compile_cache is None and jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    return enable_compile_cache(args.compile_cache)


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad command line answered as every other bad input: one `error: ...` line
    naming the option (and where to read about it), exit status 2; no usage dump."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jpaged", description="PagedAttention inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts")
    g.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts (each one request)")
    g.add_argument("--prompts-file", help="JSONL file with a 'prompt' field per line")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate at most per sample; refused past what the model's context leaves after "
                   "the prompt (default: 256, or to the end of the context when less is left)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of this mass")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--seed", type=int, default=None,
                   help="makes sampling reproducible (with --temperature > 0), whatever else runs: prompt i samples "
                   "with seed S + i*N (N: --n; its sample j with S + i*N + j, modulo 2**32), so the prompts draw "
                   "differently and prompt 0 draws as it does alone (default: a fresh seed per request)")
    g.add_argument("--same-seed", action="store_true",
                   help="with --seed S: every prompt samples with S itself, as it would alone")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--beam-width", type=int, default=1, help="beam search with this many beams")
    add_engine_arguments(g)
    g.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as given")
    g.add_argument("--json", action="store_true", help="one JSON object per request, then a summary line")
    add_process_arguments(g, "process 0 reads the prompts and prints the outputs; the others take process 0's "
                          "prompts (their own are ignored) and print nothing")
    v = sub.add_parser("serve", help="serve the OpenAI API (completions, chat completions) over HTTP")
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    v.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    v.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the file's)")
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but "
                   "/health (default: $JPAGED_API_KEY if set)")
    v.add_argument("--max-waiting", type=int, default=256, help="requests waiting for the engine, past which "
                   "new ones get 503 (default: 256)")
    v.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body in bytes (413 above; "
                   "default: 1048576, 1 MiB)")
    v.add_argument("--grace-period", type=float, default=30.0, help="seconds running requests get to finish "
                   "after SIGTERM (default: 30)")
    v.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="start serving at once, without compiling every step shape first (requests then wait for "
                   "the compilations of the shapes they meet)")
    add_engine_arguments(v)
    add_process_arguments(v, "process 0 serves HTTP; the others serve nothing and run process 0's requests, step "
                          "by step; when one of them goes away, the others end (process 0 answering the requests "
                          "in flight with an error)")
    c = sub.add_parser("convert", help="save a model as a jpaged (orbax) checkpoint that loads in seconds")
    c.add_argument("--model", help="a .gguf file or a HF checkpoint directory of a supported family (default: "
                   "embedded SmolLM2-135M-Instruct)")
    c.add_argument("--out", default=None, help="new directory to write (default: checkpoints/<model name>)")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="of the saved parameters")
    return parser


def add_engine_arguments(parser) -> None:
    """The `EngineConfig` options, shared by `generate` and `serve`."""
    parser.add_argument("--model", help="a .gguf file, a HF checkpoint directory of a supported family or a "
                        "jpaged checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (a power of two)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks, null block included")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="KV pool size when --num-blocks is not given")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="of the weights and the KV pool")
    parser.add_argument("--quantization", default=None, choices=["int8"],
                        help="weight-only: int8 dense weights with per-output-channel scales (a Q8_0 GGUF's blocks "
                        "kept as they are); norms and the KV pool stay --dtype, and --dtype bfloat16 computes the int8 "
                        "products in bfloat16 (faster for many rows where the CPU has AVX512-BF16)")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "native", "pallas", "xla"],
                        help="auto: the Pallas kernels on a GPU, the native C++ kernel on a CPU (where it was "
                        "built at install), else the XLA path")
    parser.add_argument("--interpret", action="store_true",
                        help="run the Pallas kernels in the Pallas interpreter (slow: for checking them on a CPU)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once, at most")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens a step computes, at most: decode tokens first, then prompt chunks (default: "
                        "max(context, 2048); on a CPU with chunked prefill at most 4096)")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="one ragged step under the token budget, long prompts in chunks, mixed with decode "
                        "(default); --no-enable-chunked-prefill: the paper's separate prefill and decode steps")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0,
                        help="tokens of one prompt a step computes, at most (0: no cap but the budget)")
    parser.add_argument("--speculative-method", default=None, choices=["ngram", "draft-layers"],
                        help="speculative decoding: ngram (prompt lookup) or draft-layers (the model's first layers "
                        "as its draft) proposes draft tokens, verified in one step with exact acceptance "
                        "(default: off)")
    parser.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                        help="draft tokens a sequence verifies per step (with --speculative-method)")
    parser.add_argument("--prompt-lookup-min", type=int, default=1, metavar="N",
                        help="the shortest suffix the ngram proposer matches (default 1)")
    parser.add_argument("--prompt-lookup-max", type=int, default=4, metavar="N",
                        help="the longest suffix the ngram proposer matches (default 4)")
    parser.add_argument("--speculative-draft-layers", type=int, default=None, metavar="L",
                        help="the draft-layers method's draft: the model's first L layers (default: half)")
    parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                        help="what happens to the latest requests when KV blocks run out")
    parser.add_argument("--swap-space", type=float, default=4.0, metavar="GiB",
                        help="GiB of CPU block pool for --preemption-mode swap (capped at the device pool's size)")
    parser.add_argument("--enable-prefix-caching", action="store_true", help="reuse the KV blocks of shared prompt prefixes")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule and pack the next decode step while one runs, reading its tokens a step late "
                        "(the same outputs; EngineConfig.async_scheduling); default: on for jpaged serve in one "
                        "process, off otherwise")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="devices to split the model and the KV pool over by heads (on a CPU, force devices "
                        "with XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="devices to split the KV pool over by blocks, each running the requests placed on it")
    parser.add_argument("--expert-parallel-size", type=int, default=None, metavar="N",
                        help="a mixture of experts: devices to split the experts over, whole experts on each (the "
                        "tensor-parallel devices, so N = --tensor-parallel-size; or with tensor parallel size 1 a mesh "
                        "axis of N devices on which attention runs whole); default 1: not split")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="vLLM's flag: --expert-parallel-size = --tensor-parallel-size")
    parser.add_argument("--compile-cache", default=None, metavar="DIR|none",
                        help="JAX's persistent compilation cache, where a second start finds its executables "
                        f"(default: {default_compile_cache_dir()}, unless JAX_COMPILATION_CACHE_DIR is set; "
                        "'none': off)")


def add_process_arguments(parser, roles: str) -> None:
    """The flags of one process among several (`jpaged.device.distributed`), shared by `generate` and
    `serve`; `roles` says what process 0 and the others do."""
    parser.add_argument("--coordinator-address", metavar="HOST:PORT", default=None,
                        help="several processes (jax.distributed): process 0's address, where it waits for the "
                        "others; every process runs the same command with its own --process-id")
    parser.add_argument("--num-processes", type=int, default=1,
                        help="processes taking part (with --coordinator-address)")
    parser.add_argument("--process-id", type=int, default=0, help=f"this process's id, 0..N-1: {roles}")
    parser.add_argument("--join-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="how long each process waits for all the others to join (with --coordinator-address); "
                        "past it: one error line, exit status 2")


def several_processes(args) -> bool:
    """Whether this process is one of several (`--coordinator-address`, `--num-processes`,
    `--process-id`, `--join-timeout` checked: ValueError before anything starts)."""
    from jpaged.device import distributed

    if args.coordinator_address is not None or args.num_processes != 1:
        distributed.check_address(args.coordinator_address, args.num_processes, args.process_id,
                                  initialization_timeout=args.join_timeout)
        return True
    if args.process_id != 0:
        raise ValueError("--process-id needs --coordinator-address and --num-processes (several processes)")
    return False


def join(args) -> None:
    """Joins the other processes (`distributed.initialize`, with `--join-timeout`)."""
    from jpaged.device import distributed

    distributed.initialize(args.coordinator_address, args.num_processes, args.process_id,
                           initialization_timeout=args.join_timeout)


def check_listen(host: str, port: int) -> None:
    """Raises ValueError, naming the flags, when `jpaged serve` could not listen on host:port. Binds as
    uvicorn does (SO_REUSEADDR), so a port whose last server stopped a moment ago, its connections in
    TIME_WAIT, is free; one another socket listens on is not."""
    import socket

    if not 0 < port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}): pass another --port or --host") from None


def check_swap_space(args) -> None:
    """`--swap-space`, whatever `--preemption-mode` says (it is used only with swap)."""
    if not args.swap_space >= 0:  # NaN included
        raise ValueError(f"swap_space must be >= 0 GiB, got {args.swap_space:g}: pass --swap-space 0 or more")


def async_scheduling(args) -> bool:
    """`--[no-]async-scheduling`; by default on for `jpaged serve` in one process (as vLLM serves; one stream
    faster on a 2-core CPU: `bench/README.md`), off for `generate` and for several processes (whose lockstep
    is tested stepping synchronously)."""
    if args.async_scheduling is not None:
        return args.async_scheduling
    return args.command == "serve" and not several_processes(args)


def engine_config(args):
    """The `EngineConfig` the options ask for; every option checked here, before anything loads."""
    from jpaged.engine import EngineConfig

    check_swap_space(args)
    return EngineConfig(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
                        kv_cache_memory=args.kv_cache_memory, dtype=args.dtype, quantization=args.quantization,
                        attention_backend=args.attention_backend, interpret=args.interpret,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_chunked_prefill=args.enable_chunked_prefill,
                        long_prefill_token_threshold=args.long_prefill_token_threshold,
                        speculative_method=args.speculative_method,
                        num_speculative_tokens=args.num_speculative_tokens,
                        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
                        speculative_draft_layers=args.speculative_draft_layers,
                        preemption_mode=args.preemption_mode,
                        swap_space=args.swap_space if args.preemption_mode == "swap" else 0.0,
                        enable_prefix_caching=args.enable_prefix_caching,
                        async_scheduling=async_scheduling(args),
                        tensor_parallel_size=args.tensor_parallel_size,
                        data_parallel_size=args.data_parallel_size,
                        expert_parallel_size=expert_parallel_size(args))


def expert_parallel_size(args) -> int:
    """--expert-parallel-size, or --tensor-parallel-size under vLLM's --enable-expert-parallel (1: neither)."""
    if args.expert_parallel_size is not None and args.enable_expert_parallel \
            and args.expert_parallel_size != args.tensor_parallel_size:
        raise ValueError(f"--enable-expert-parallel splits the experts over the --tensor-parallel-size "
                         f"{args.tensor_parallel_size} devices; --expert-parallel-size {args.expert_parallel_size} "
                         "says otherwise: give one of the two")
    if args.expert_parallel_size is not None:
        return args.expert_parallel_size
    return args.tensor_parallel_size if args.enable_expert_parallel else 1


def serve(args) -> int:
    """One process: the server. Several (`--coordinator-address ...`): process 0 serves, every process
    runs its steps (`jpaged.engine.lockstep`); see `_serve_lockstep`."""
    import pathlib

    from jpaged.engine import LLMEngine
    from jpaged.entrypoints import server

    several = several_processes(args)
    first = args.process_id == 0  # several processes: process 0 serves HTTP, the others follow it
    check_swap_space(args)
    if first:  # the server's options, and its port, before anything loads
        name = args.served_model_name or (pathlib.Path(args.model).stem if args.model else "SmolLM2-135M-Instruct")
        server_config = server.ServerConfig(model_name=name, api_key=server.api_key_from(args.api_key),
                                            max_request_bytes=args.max_request_bytes, max_waiting=args.max_waiting,
                                            grace_period_s=args.grace_period)
        check_listen(args.host, args.port)
    if several:
        return _serve_lockstep(args, server_config if first else None)
    config = engine_config(args)
    use_compile_cache(args)
    status = _Status(sys.stderr.isatty())
    status.say(f"loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...")
    logging.getLogger("jpaged.server").setLevel(logging.INFO)  # its start and stop: INFO lines, not warnings
    engine = LLMEngine(config)
    if args.warm_up:
        warm_up(engine, sys.stderr.isatty())
    server.serve(engine, server_config, host=args.host, port=args.port)
    return 0


def _serve_lockstep(args, server_config) -> int:
    """`jpaged serve` as one of several processes: joins the others, opens the link between them
    (`distributed.open_link`) before anything loads, so that a process that goes away, from then on,
    ends the others: one `error: ...` line naming it, exit status 1 (process 0 first answers the requests
    in flight with a 500 error, or an error event when streamed). Process 0 serves through a `Lockstep`
    and, when it stops (SIGTERM), ends the others; they print one line saying they follow it, run its
    steps and serve nothing."""
    import jax

    from jpaged.device import distributed
    from jpaged.engine import LLMEngine
    from jpaged.engine.lockstep import Lockstep
    from jpaged.entrypoints import server

    first, me, num = args.process_id == 0, args.process_id, args.num_processes
    join(args)
    config = engine_config(args)  # checked against the global devices: alike on every process
    failing: dict = {}  # process 0: the server's `fail`, once it is built

    def say(line: str) -> None:  # one write: print's text and newline are two, and on an unbuffered stderr
        sys.stderr.write(line + "\n")  # JAX's own fatal log line (its coordination service) landed between
        sys.stderr.flush()

    def lost(message: str) -> None:  # from the link's thread, whatever the main thread is stuck in
        if first:
            say(f"error: {message}: the engine runs on every process, so process 0 stops serving too (the "
                "requests in flight get an error)")
            if "fail" in failing and failing["fail"](message):
                time.sleep(1)  # the handlers send their errors
        else:
            say(f"error: {message}: process {me} stops too")
        sys.stdout.flush()
        os._exit(1)  # a collective under way never returns, nor would jax.distributed's shutdown

    link = distributed.open_link(args.coordinator_address, on_lost=lost)
    try:
        use_compile_cache(args)
        status = _Status(first and sys.stderr.isatty())
        status.say(f"loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...")
        lockstep = Lockstep(LLMEngine(config), link)
        if not first:
            if args.warm_up and lockstep.engine.shapes is not None:
                lockstep.engine.warm_up()  # compiles alone: no collective
            print(f"[jpaged] process {me} of {num} follows process 0, which serves HTTP: it runs process 0's steps "
                  "and ends when process 0 stops", file=sys.stderr, flush=True)
            lockstep.follow()
            print(f"[jpaged] process 0 stopped: process {me} ends", file=sys.stderr, flush=True)
            jax.distributed.shutdown()  # with process 0's: its coordination service ends in order
            return 0
        logging.getLogger("jpaged.server").setLevel(logging.INFO)
        if args.warm_up:
            warm_up(lockstep.engine, sys.stderr.isatty())

        def stop() -> None:  # the server has stopped stepping (SIGTERM): the others end, then JAX's runtime
            lockstep.stop()
            jax.distributed.shutdown()

        app = server.build_app(lockstep, server_config, on_stop=stop)
        failing["fail"] = app.state.fail
        server.serve(lockstep, server_config, host=args.host, port=args.port, app=app)
        return 0
    except BaseException:  # e.g. a bad option, raised alike everywhere: each says it, none blames the others
        link.close()
        raise


def warm_up(engine, at_terminal: bool) -> None:
    """`engine.warm_up()` with its progress on stderr (a counter at a terminal, a line per tenth
    otherwise) and its time printed."""
    if engine.shapes is None:
        print("[jpaged] no warm-up with data parallel: each new step shape compiles when first met", file=sys.stderr)
        return
    shown = [0]

    def progress(done: int, total: int) -> None:
        if at_terminal:
            print(f"\r[jpaged] warming up: compiled {done}/{total}", end="", file=sys.stderr, flush=True)
        elif done * 10 // total > shown[0] or done == total:
            shown[0] = done * 10 // total
            print(f"[jpaged] warming up: compiled {done}/{total}", file=sys.stderr, flush=True)

    print("[jpaged] warming up: compiling every step shape the limits allow (--no-warm-up skips it) ...",
          file=sys.stderr, flush=True)
    summary = engine.warm_up(progress)
    if at_terminal and summary.built:
        print(file=sys.stderr)
    cached = f", {summary.cache_hits} of them from the compilation cache" if summary.cache_hits else ""
    print(f"[jpaged] warmed up in {summary.seconds:.1f} s: {summary.num_executables} executables "
          f"({summary.built} built{cached})", file=sys.stderr, flush=True)


def convert(args) -> int:
    import pathlib

    from jpaged.engine import DTYPES
    from jpaged.weights import checkpoint, default_model_path, load_model, read_config

    source = pathlib.Path(args.model) if args.model else default_model_path()
    out = pathlib.Path(args.out or pathlib.Path("checkpoints") / source.stem)
    if out.exists():
        raise ValueError(f"{out} already exists: pass --out with a new directory")
    read_config(source)  # a file that is not a model is named before anything loads
    t0 = time.perf_counter()
    loaded = load_model(source, dtype=DTYPES[args.dtype])
    load_s = time.perf_counter() - t0
    path = checkpoint.save(loaded, out)
    print(path)
    print(f"read {source.name} in {load_s:.1f} s, wrote the checkpoint in {time.perf_counter() - t0 - load_s:.1f} s",
          file=sys.stderr)
    return 0


def read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        record = json.loads(line)
                        if not isinstance(record, dict) or "prompt" not in record:
                            raise ValueError(f"{args.prompts_file}:{number}: each line needs a 'prompt' field")
                        prompts.append(record["prompt"])
        except OSError as e:
            raise ValueError(f"cannot read --prompts-file: {e.strerror}: {args.prompts_file}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.prompts_file}: not JSONL ({e.msg} at line {e.lineno})") from None
    if not prompts:
        raise ValueError("no prompt given: pass PROMPT arguments or --prompts-file FILE.jsonl")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompt {i} is empty: give at least one non-blank character")
    return prompts


def seeds(seed, num_prompts: int, n: int, same: bool) -> list:
    """Each prompt's seed for `--seed`: S + i*n for prompt i (modulo 2**32), so no two samples of the
    run share a seed (sample j of a request draws with its seed + j) and prompt 0 draws as alone;
    with `same`, S for every prompt. None (no --seed): a fresh seed per request."""
    if seed is None or same:
        return [seed] * num_prompts
    return [(seed + i * n) % 2**32 for i in range(num_prompts)]


def check_max_tokens(args) -> None:
    """`--max-tokens` against the model's context, from its metadata alone (before anything loads)."""
    from jpaged.weights import read_config

    if args.max_tokens is None or not args.max_tokens >= 1:
        return  # the default, or refused by SamplingParams with its own message
    context = read_config(args.model).max_model_len
    if args.max_tokens >= context:
        raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the model's context of "
                         f"{context} tokens: pass --max-tokens at most {context - 1} (less the prompt's tokens)")


def generate(args) -> int:
    from jpaged.core.sampling_params import SamplingParams
    from jpaged.device import distributed
    from jpaged.entrypoints.llm import LLM

    several = several_processes(args)
    first = args.process_id == 0  # several processes: process 0 reads the prompts, the others run them
    texts = read_prompts(args) if first else []
    given = args.max_tokens is not None
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens if given else 256, seed=args.seed, beam_width=args.beam_width)
    check_swap_space(args)
    check_max_tokens(args)  # the model's metadata alone: JAX has not started
    if several:  # joins the others first: the engine's settings are checked against the global devices
        join(args)
        texts = distributed.broadcast(texts)  # process 0's: every process checks them alike below
    config = engine_config(args)
    use_compile_cache(args)
    status = _Status(first and sys.stderr.isatty())
    status.say(f"loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...")
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(config))
    load_s = time.perf_counter() - t0
    status.say(f"loaded in {load_s:.1f} s; generating (each new step shape compiles once, first) ...")
    prompts = texts
    if not args.no_chat_template:
        if llm.tokenizer.chat_template is None:
            raise ValueError("this model has no chat template: pass --no-chat-template")
        prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in texts]
    engine = llm.engine
    per_prompt = []
    for i, (prompt, seed) in enumerate(zip(prompts, seeds(args.seed, len(prompts), args.n, args.same_seed))):
        room = engine.max_model_len - len(engine.tokenize(prompt)[1])  # < 1: refused by LLM.generate, saying why
        if given and 0 < room < args.max_tokens:
            raise ValueError(f"prompt {i}: its {engine.max_model_len - room} tokens and --max-tokens {args.max_tokens} "
                             f"exceed the model's context of {engine.max_model_len} tokens: pass --max-tokens at "
                             f"most {room}, or shorten the prompt")
        per_prompt.append(dataclasses.replace(params, seed=seed, max_tokens=params.max_tokens if given
                                              else max(1, min(params.max_tokens, room))))
    params = per_prompt
    engine.add_observer(status.observe)
    # several processes: every request goes through LLM.generate, which hands process 0's to the others
    stream = len(prompts) == 1 and args.n == 1 and args.beam_width == 1 and not args.json and not several
    if stream:
        outputs = [_stream(llm, prompts[0], params[0], status)]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=first and not args.json and sys.stderr.isatty())
    status.done()
    failed = [r for r in outputs if r.error is not None]
    if not first:
        return 1 if failed else 0
    elapsed = llm.last_run["elapsed_s"]
    stats = engine.stats()
    output_tokens = sum(len(o.token_ids) for r in outputs for o in r.outputs)
    summary = {
        "num_requests": len(outputs), "output_tokens": output_tokens, "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(output_tokens / elapsed, 2) if elapsed > 0 else None,
        "num_blocks": engine.num_blocks, "block_size": args.block_size,
        "peak_used_blocks": stats["peak_used_blocks"], "free_blocks_at_end": stats["num_free_blocks"],
        "kv_utilization": round(stats["kv_utilization"], 4) if stats["kv_utilization"] is not None else None,
        "num_preemptions": stats["num_preemptions"], "prefix_cache_hit_rate": round(stats["prefix_cache_hit_rate"], 4),
        "num_compilations": stats["num_compilations"], "compile_s": round(llm.last_run["compile_s"], 3),
        "load_s": round(load_s, 3), "num_devices": stats["num_devices"],
        "kv_head_replication": stats["kv_head_replication"],
    }
    if args.json:
        for text, r in zip(texts, outputs):
            print(json.dumps({**r.to_json(), "prompt": text}))  # the text given, not the chat-templated prompt
        print(json.dumps({"summary": summary}))
    else:
        if not stream:
            for r in outputs:
                for o in r.outputs:
                    label = f"[{r.request_id}]" + (f"[{o.index}]" if len(r.outputs) > 1 else "")
                    print(f"{label} {o.text}")
        util = f"{summary['kv_utilization']:.1%}" if summary["kv_utilization"] is not None else "n/a"
        print(f"{output_tokens} tokens in {elapsed:.2f}s ({summary['output_tokens_per_s']} tokens/s), "
              f"KV blocks peak {summary['peak_used_blocks']}/{engine.num_blocks}, KV utilization {util}, "
              f"preemptions {summary['num_preemptions']} (load {load_s:.1f}s, compile {summary['compile_s']:.1f}s)",
              file=sys.stderr)
    for r in failed:
        print(f"error: request {r.request_id} failed: {r.error}", file=sys.stderr)
    return 1 if failed else 0


class _Status:
    """What the CLI is doing, on stderr at a terminal only (loading, compiling), until the first
    output: a terminal never sits silent for the seconds those take, and piped output stays clean."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.compile_s, self.num_compiled = 0.0, 0

    def say(self, message: str) -> None:
        if self.enabled:
            print(f"[jpaged] {message}", file=sys.stderr, flush=True)

    def observe(self, record) -> None:
        """A step observer: reports the step shapes compiled so far."""
        if record.compiled:
            self.compile_s += record.compile_seconds
            self.num_compiled += sum(c.compile_seconds > 0 for c in record.calls)
            self.say(f"compiled {self.num_compiled} executables ({self.compile_s:.1f} s)")

    def done(self) -> None:
        self.enabled = False


def _stream(llm, prompt, params, status):
    """Runs one request, printing its text as it grows; returns its final RequestOutput."""
    engine = llm.engine
    engine.add_request("0", prompt, params)
    compile_before = engine.runner.compile_seconds
    start = time.perf_counter()
    printed, final = 0, None
    while engine.has_unfinished():
        for out in engine.step():
            text = out.outputs[0].text
            if text:
                status.done()  # the text has begun: no status line in its middle
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
            if out.finished:
                final = out
    sys.stdout.write("\n")
    compile_s = engine.runner.compile_seconds - compile_before
    llm.last_run = {"elapsed_s": time.perf_counter() - start - compile_s, "compile_s": compile_s}
    return final


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        return {"generate": generate, "serve": serve, "convert": convert}[args.command](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
