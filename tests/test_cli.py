"""`jpaged generate`: bad input exits 2 with one line and no traceback; --json has the documented shape.

In-process tests reuse the session's loaded model (`load_model` is pointed at it) so the suite
loads the GGUF once; one subprocess test runs the real console script end to end.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from jpaged.device.runner import DeviceCall, ModelRunner
from jpaged.engine import llm_engine
from jpaged.entrypoints import cli


@pytest.fixture
def run_cli(default_model, monkeypatch, capsys):
    monkeypatch.setattr(llm_engine, "load_model", lambda path, dtype=None: default_model if path is None
                        else REAL_LOAD_MODEL(path, dtype=dtype))

    def run(*argv):
        code = cli.main(["generate", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


REAL_LOAD_MODEL = llm_engine.load_model


@pytest.mark.parametrize("argv, message", [
    (["hi", "--model", "/no/such/model"], "/no/such/model"),
    (["hi", "--max-tokens", "0"], "max_tokens"),
    (["hi", "--temperature", "-1"], "temperature"),
    (["hi", "--top-p", "0"], "top_p"),
    (["hi", "--top-p", "1.5"], "top_p"),
    (["hi", "--top-k", "-2"], "top_k"),
    (["hi", "--block-size", "12"], "power of two"),
    (["   "], "empty"),
    (["hi", "--num-blocks", "3", "--block-size", "4"], "blocks"),
    (["word " * 9000, "--no-chat-template"], "context"),
    (["hi", "--n", "3"], "3 identical samples: set temperature > 0"),
    (["hi", "--beam-width", "3", "--temperature", "0.8"], "beam search is deterministic"),
    (["hi", "--n", "0"], "n must be an integer >= 1"),
    (["hi", "--beam-width", "0"], "beam_width must be an integer >= 1"),
    (["hi", "--seed", "-2"], "seed must be None or an integer"),
    (["hi", "--kv-cache-memory", "lots"], "cannot read memory size 'lots'"),
    (["hi", "--kv-cache-memory", "0GB"], "kv_cache_memory must be at least 1 byte, got '0GB'"),
    (["hi", "--kv-cache-memory", "0"], "kv_cache_memory must be at least 1 byte, got '0': give a size such as '1GiB'"),
    (["hi", "--max-tokens", "1000000000"], "context of 8192 tokens: pass --max-tokens at most 8191"),
    (["hi", "--swap-space", "-1"], "swap_space must be >= 0 GiB, got -1: pass --swap-space 0 or more"),
    (["hi", "--num-processes", "2", "--coordinator-address", "h:1", "--join-timeout", "0"],
     "--join-timeout must be a number of seconds > 0"),
    (["hi", "--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1, got 0"),
    (["hi", "--max-num-batched-tokens", "0"], "max_num_batched_tokens must be an integer >= 1"),
    (["hi", "--speculative-method", "ngram"], "needs num_speculative_tokens >= 1 (--num-speculative-tokens K)"),
    (["hi", "--num-speculative-tokens", "3"], "needs a speculative_method (--speculative-method ngram)"),
    (["hi", "--speculative-method", "ngram", "--num-speculative-tokens", "2", "--prompt-lookup-min", "5"],
     "1 <= min <= max"),
    (["hi", "--long-prefill-token-threshold", "-1"], "long_prefill_token_threshold must be an integer >= 0"),
    (["hi", "--swap-space", "-1", "--preemption-mode", "swap"], "swap_space must be >= 0"),
    (["hi", "--num-blocks", "100000000"], "at most"),
    (["hi", "--kv-cache-memory", "1000TB"], "lower num_blocks / --num-blocks or kv_cache_memory"),
    (["hi", "--attention-backend", "pallas"], "use attention_backend='auto' or 'xla' here (the CLI's "
                                              "--attention-backend), or interpret=True (--interpret)"),
    (["hi", "--tensor-parallel-size", "64"], "64 devices asked for"),
    (["hi", "--n", "300", "--temperature", "0.5"], "max_num_seqs=256"),
    (["hi", "--num-processes", "2"], "coordinator address (--coordinator-address) must be HOST:PORT"),
    (["hi", "--num-processes", "2", "--coordinator-address", "localhost"], "must be HOST:PORT"),
    (["hi", "--num-processes", "2", "--coordinator-address", "h:70000"], "must be HOST:PORT"),
    (["hi", "--num-processes", "0", "--coordinator-address", "h:1234"], "(--num-processes) must be an integer >= 1"),
    (["hi", "--num-processes", "2", "--coordinator-address", "h:1234", "--process-id", "2"],
     "(--process-id) must be in 0..1 for 2 processes, got 2"),
    (["hi", "--process-id", "1"], "--process-id needs --coordinator-address and --num-processes"),
])
def test_bad_input_exits_2_with_one_line(run_cli, argv, message):
    code, out, err = run_cli(*argv, "--max-tokens" if "--max-tokens" not in argv else "--json", *(
        ["4"] if "--max-tokens" not in argv else []))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0]
    assert "Traceback" not in err and out == ""


def test_options_are_checked_before_the_model_loads(run_cli, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(llm_engine, "load_model", no_load)
    for argv in (["--max-num-seqs", "0"], ["--kv-cache-memory", "2XB"], ["--num-blocks", "100000000"],
                 ["--kv-cache-memory", "1TiB"], ["--n", "2"], ["--max-tokens", "8192"], ["--swap-space", "-1"],
                 ["--kv-cache-memory", "0"]):
        code, _, err = run_cli("hi", *argv)
        assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err


def test_several_processes_flags_are_checked_before_joining(run_cli, monkeypatch):
    from jpaged.device import distributed

    def no_join(*args, **kwargs):
        raise AssertionError("jax.distributed was joined before the flags were checked")

    monkeypatch.setattr(distributed, "initialize", no_join)
    for argv in (["--num-processes", "3", "--coordinator-address", "h:1", "--process-id", "-1"],
                 ["--num-processes", "2", "--coordinator-address", "h:1", "--max-tokens", "0"],
                 ["--num-processes", "2", "--coordinator-address", "h:1", "--max-tokens", "9000"],
                 ["--num-processes", "2", "--coordinator-address", "h:1", "--swap-space", "-1"]):
        code, _, err = run_cli("hi", *argv)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--max-waiting", "0"], "max_waiting=0: --max-waiting (requests that may wait for the engine) must be an "
                             "integer >= 1"),
    (["--grace-period", "-1"], "grace_period_s=-1.0: --grace-period (seconds running requests get to finish after "
                               "SIGTERM) must be a number >= 0"),
    (["--max-request-bytes", "0"], "max_request_bytes=0: --max-request-bytes (the largest request body) must be"),
    (["--max-num-seqs", "0"], "max_num_seqs must be"),
    (["--model", "/no/such/model"], "/no/such/model"),
    (["--api-key", ""], "the API key is empty"),
    (["--host", "192.0.2.1"], "cannot listen on 192.0.2.1:8000"),  # an address this machine does not have
])
def test_serve_refuses_bad_options_before_loading(monkeypatch, capsys, argv, message):
    from jpaged.entrypoints import server

    def no_serve(*args, **kwargs):
        raise AssertionError("the server started with bad options")

    monkeypatch.setattr(server, "serve", no_serve)
    monkeypatch.setattr(llm_engine, "load_model", no_serve)
    code = cli.main(["serve", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err and "Traceback" not in err, err


def test_a_port_is_free_once_its_last_server_stopped_and_busy_while_one_listens():
    """`check_listen` binds as uvicorn does: a port whose server (uvicorn, listening with SO_REUSEADDR)
    just closed a connection, TIME_WAIT on the server's side, can be listened on again at once; a port
    another socket listens on cannot."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port} .*pass another --port or --host"):
            cli.check_listen("127.0.0.1", port)
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()  # the server's side closes first: it holds the port in TIME_WAIT
        client.close()
    time.sleep(0.1)
    with pytest.raises(OSError):  # what the check once did: a plain bind
        with socket.socket() as plain:
            plain.bind(("127.0.0.1", port))
    cli.check_listen("127.0.0.1", port)


def test_serve_warms_up_by_default_with_its_time_printed(default_model, monkeypatch, capsys):
    """`jpaged serve` compiles every step shape before serving (progress and time on stderr);
    `--no-warm-up` starts at once."""
    from jpaged.device.runner import WarmUp
    from jpaged.engine import LLMEngine
    from jpaged.entrypoints import server

    served, warmed = [], []

    def fake_warm_up(engine, progress=None, **kw):
        for done in (1, 2, 3):
            progress(done, 3)
        warmed.append(engine)
        engine.warm_up_summary = WarmUp(executables={"prefill_step": 2, "decode_step": 1}, built=3, cache_hits=1,
                                        seconds=4.25)
        return engine.warm_up_summary

    monkeypatch.setattr(llm_engine, "load_model", lambda path, dtype=None: default_model)
    monkeypatch.setattr(server, "serve", lambda engine, config, **kw: served.append(engine))
    monkeypatch.setattr(LLMEngine, "warm_up", fake_warm_up)
    argv = ["serve", "--num-blocks", "16", "--port", str(_free_port())]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert warmed == served and len(served) == 1, err
    assert "[jpaged] warming up: compiled 3/3" in err and (
        "[jpaged] warmed up in 4.2 s: 3 executables (3 built, 1 of them from the compilation cache)") in err, err
    assert cli.main([*argv, "--no-warm-up"]) == 0
    assert len(served) == 2 and len(warmed) == 1 and "warm" not in capsys.readouterr().err
    # one process schedules asynchronously unless told not to (as vLLM serves)
    assert served[0].config.async_scheduling and served[1].config.async_scheduling
    assert cli.main([*argv, "--no-warm-up", "--no-async-scheduling"]) == 0
    assert not served[2].config.async_scheduling


def test_async_scheduling_is_serves_default_in_one_process_only():
    """`--[no-]async-scheduling` wins; unset, `jpaged serve` in one process schedules asynchronously, `jpaged
    generate` and a process of several synchronously."""
    parser = cli.build_parser()
    several = ["--coordinator-address", "127.0.0.1:29500", "--num-processes", "2", "--process-id", "1"]
    for argv, want in ((["serve"], True), (["serve", "--no-async-scheduling"], False), (["generate", "hi"], False),
                       (["generate", "hi", "--async-scheduling"], True), (["serve", *several], False),
                       (["serve", *several, "--async-scheduling"], True)):
        assert cli.async_scheduling(parser.parse_args(argv)) is want, argv


def test_compile_cache_flag(monkeypatch, tmp_path):
    """`--compile-cache`: a directory, or 'none'; not given, jpaged's user cache folder unless JAX already has
    a cache directory (as here: the test session's)."""
    import jax

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli.default_compile_cache_dir() == str(tmp_path / "jpaged" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cli.default_compile_cache_dir() == str(tmp_path / "home" / ".cache" / "jpaged" / "xla")
    enabled = []
    monkeypatch.setattr(cli, "enable_compile_cache", lambda path=None: enabled.append(path) or path)
    parser = cli.build_parser()
    for command in (["generate", "hi"], ["serve"]):
        args = parser.parse_args([*command, "--compile-cache", str(tmp_path / "c")])
        assert cli.use_compile_cache(args) == str(tmp_path / "c") and enabled[-1] == str(tmp_path / "c")
        cli.use_compile_cache(parser.parse_args([*command, "--compile-cache", "none"]))
        assert enabled[-1] == "none"
    args = parser.parse_args(["serve"])
    session = jax.config.jax_compilation_cache_dir
    try:  # (nothing compiles meanwhile: a cache already in use keeps its directory anyway)
        jax.config.update("jax_compilation_cache_dir", None)
        cli.use_compile_cache(args)
        assert enabled[-1] is None  # jpaged's default folder (`enable_compile_cache(None)`)
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
        before = len(enabled)
        assert cli.use_compile_cache(args) == str(tmp_path / "theirs") and len(enabled) == before  # left alone
    finally:
        jax.config.update("jax_compilation_cache_dir", session)


def test_memory_sizes_in_every_unit_and_terabytes():
    from jpaged.device.kv_cache import parse_memory_size

    assert parse_memory_size("1TiB") == 2**40 and parse_memory_size("1TB") == 10**12
    assert parse_memory_size("1T") == 2**40 and parse_memory_size(" 2.5 GiB ") == int(2.5 * 2**30)
    assert parse_memory_size("512MB") == 512 * 10**6 and parse_memory_size(4096) == 4096
    for bad in ("", "1.2.3GB", "-1GB", "0", "5XB", 0, True, "GB"):
        with pytest.raises(ValueError, match="cannot read memory size"):
            parse_memory_size(bad)


def test_status_at_a_terminal_only(capsys):
    from jpaged.engine.observer import StepRecord

    for at_terminal in (True, False):
        status = cli._Status(at_terminal)
        status.say("loading the model ...")
        record = StepRecord(0, "prefill", 1, 3, 16, 1, None, (DeviceCall("prefill_step", (), 0.1, 0.1, 2.5),),
                            None, 0.1, 0.1, 2.5, None, 0, 1, 0, (), ())
        status.observe(record)
        status.done()
        status.say("nothing after the first output")
        err = capsys.readouterr().err
        if at_terminal:
            assert err.splitlines() == ["[jpaged] loading the model ...", "[jpaged] compiled 1 executables (2.5 s)"]
        else:
            assert err == ""


def test_a_request_that_fails_in_a_step_exits_1(run_cli, monkeypatch):
    def fail(self, inputs, *, decode):
        raise RuntimeError("injected into the model step")

    monkeypatch.setattr(ModelRunner, "run_step", fail)
    code, out, err = run_cli("hi", "--max-tokens", "4", "--json", "--num-blocks", "16")
    assert code == 1
    assert json.loads(out.splitlines()[0])["error"] == "RuntimeError: injected into the model step"
    assert err.strip().splitlines()[-1] == "error: request 0 failed: RuntimeError: injected into the model step"


def test_not_a_model_directory(run_cli, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    code, _, err = run_cli("hi", "--model", str(tmp_path))
    assert code == 2 and str(tmp_path) in err and "expected" in err


def test_json_output_in_input_order(run_cli):
    prompts = ["Name a fruit.", "What is 2+2?", "Say hello."]
    code, out, _ = run_cli(*prompts, "--json", "--max-tokens", "8", "--num-blocks", "64")
    assert code == 0
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert len(lines) == len(prompts) + 1
    for i, (record, prompt) in enumerate(zip(lines, prompts)):
        assert record["request_id"] == str(i) and record["prompt"] == prompt  # the text given, not the template
        (o,) = record["outputs"]
        assert 1 <= len(o["token_ids"]) <= 8 and o["finish_reason"] in ("stop", "length")
        assert o["cumulative_logprob"] < 0
    summary = lines[-1]["summary"]
    assert summary["num_requests"] == 3 and summary["num_blocks"] == 64
    assert summary["output_tokens"] == sum(len(r["outputs"][0]["token_ids"]) for r in lines[:-1])
    assert summary["free_blocks_at_end"] == 63 and 0 < summary["peak_used_blocks"] < 64
    assert summary["elapsed_s"] > 0 and "num_preemptions" in summary and "prefix_cache_hit_rate" in summary


def test_prompts_file_and_no_chat_template(run_cli, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"}) + "\n")
    code, out, _ = run_cli("--prompts-file", str(path), "--no-chat-template", "--json", "--max-tokens", "4",
                           "--num-blocks", "32")
    assert code == 0
    record = json.loads(out.splitlines()[0])
    assert record["prompt"].startswith("<|im_start|>")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    code, _, err = run_cli("--prompts-file", str(bad))
    assert code == 2 and "'prompt' field" in err


def test_console_script_answers_paris():
    """The README's first command, end to end in a fresh process."""
    result = subprocess.run([sys.executable, "-m", "jpaged.entrypoints.cli", "generate", "What is the capital of France?",
                             "--temperature", "0", "--max-tokens", "32", "--num-blocks", "64"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    summary = result.stderr.strip().splitlines()[-1]
    assert "tokens/s" in summary and "KV blocks peak" in summary and "/64" in summary


def test_convert_writes_a_checkpoint_that_gives_the_source_models_greedy_tokens(default_model, llm, tmp_path,
                                                                                  monkeypatch, capsys):
    from jpaged import LLM, SamplingParams, weights

    # the GGUF is read by the session already: convert that copy (reading it is tested in test_loader.py)
    monkeypatch.setattr(weights, "load_model", lambda path, dtype=None: default_model)
    out = tmp_path / "smol"
    assert cli.main(["convert", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out.absolute())
    monkeypatch.undo()
    converted = LLM(model=str(out), num_blocks=64)
    assert converted.engine.model.path == out.absolute()
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    assert ([o.outputs[0].token_ids for o in converted.generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(weights, "load_model", no_load)  # refused before anything loads
    assert cli.main(["convert", "--out", str(out)]) == 2 and "already exists" in capsys.readouterr().err
    assert cli.main(["convert", "--model", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "x")]) == 2
    assert "none.gguf: no such file" in capsys.readouterr().err


def test_an_interrupted_checkpoint_save_leaves_nothing_half_written(default_model, tmp_path, monkeypatch):
    from jpaged.weights import checkpoint

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(default_model.tokenizer), "save_pretrained", crash)  # after the parameters
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(default_model, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []  # neither the checkpoint nor its partial copy


# ---------------------------------------------------------------- issue 32: what a new user met

def test_a_malformed_option_is_one_line_without_the_usage(capsys):
    for argv, message in (
            (["generate", "hi", "--max-tokens", "ten"], "argument --max-tokens: invalid int value: 'ten'"),
            (["generate", "hi", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
            ([], "the following arguments are required: command")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
        assert err.startswith(f"error: {message}") and "--help)" in err, err


def test_an_explicit_max_tokens_past_the_prompts_room_is_refused(run_cli):
    code, out, err = run_cli("word " * 8100, "--no-chat-template", "--max-tokens", "200", "--num-blocks", "16")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: prompt 0: its 8101 tokens and --max-tokens 200 exceed the model's context of 8192 "
                          "tokens: pass --max-tokens at most 91"), err


def test_seed_gives_each_prompt_its_own_seed_unless_same_seed(run_cli):
    assert cli.seeds(3, 3, 1, same=False) == [3, 4, 5] and cli.seeds(3, 3, 2, same=False) == [3, 5, 7]
    assert cli.seeds(3, 2, 4, same=True) == [3, 3] and cli.seeds(None, 2, 1, same=False) == [None, None]
    assert cli.seeds(2**32 - 1, 2, 1, same=False) == [2**32 - 1, 0]
    help_text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help().split())
    assert "prompt i samples with seed S + i*N" in help_text and "--same-seed" in help_text

    def texts(*argv):
        code, out, err = run_cli(*argv, "--temperature", "1", "--seed", "3", "--json", "--max-tokens", "12",
                                 "--num-blocks", "32")
        assert code == 0, err
        return [tuple(json.loads(line)["outputs"][0]["token_ids"]) for line in out.splitlines()[:-1]]

    prompt = "Tell me a story about a cat."
    alone = texts(prompt)
    distinct = texts(prompt, prompt, prompt)
    assert distinct[0] == alone[0] and len(set(distinct)) == 3  # prompt 0 draws as alone; the others differ
    assert texts(prompt, prompt, "--same-seed") == alone * 2


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed_lines(argv, timeout):
    """Runs the console script; (exit status, [(seconds since start, stderr line)], stdout)."""
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "jpaged.entrypoints.cli", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        lines = [(time.monotonic() - start, line.rstrip("\n")) for line in process.stderr]
        return process.wait(timeout=timeout), lines, process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_process_whose_peers_never_come_says_so_at_once_and_ends_with_one_line(process_id):
    """Issue 32's hang: with --join-timeout 2, both ends say at once that they wait (where, how many
    joined, how long), then end with one line, within a bound, instead of waiting silently."""
    address = f"127.0.0.1:{_free_port()}"  # process 1: nobody listens there
    code, lines, out = _timed_lines(["generate", "Hi", "--coordinator-address", address, "--num-processes", "2",
                                     "--process-id", str(process_id), "--join-timeout", "2"], timeout=120)
    assert code == 2 and out == "", lines
    assert len(lines) == 2 and lines[0][1].startswith("[jpaged] ") and lines[1][1].startswith("error: "), lines
    (said_at, waiting), (ended_at, error) = lines
    assert ended_at - said_at >= 1.5  # said before the wait, not at its end
    assert address in waiting and "up to 2 s (--join-timeout)" in waiting
    if process_id == 0:
        assert "1 of 2 joined (this one)" in waiting
        assert error == (f"error: only 1 of 2 processes joined at {address} within 2 s (missing: --process-id 1): "
                         "start it with this --coordinator-address and --num-processes 2, or raise --join-timeout")
    else:
        assert "joining process 0" in waiting and "for all 2 processes to join" in waiting
        assert error.startswith(f"error: process 0 did not answer at {address} within 2 s (connection refused): "
                                "start it (the same command with --process-id 0)"), error


def test_the_processes_meet_and_a_wrong_number_of_processes_is_refused_at_once():
    """The rendezvous before JAX's runtime, as threads: three processes meet whatever order they come
    in; a process with another --num-processes, or an id given twice, is refused without waiting; when
    process 0 gives up, the ones that came give up with the same line."""
    import threading

    from jpaged.device import distributed

    def run(address, num_processes, process_id, timeout, results, said):
        try:
            distributed._rendezvous(address, num_processes, process_id, timeout,
                                    lambda message: said.append((process_id, message)))
            results[process_id] = "go"
        except ValueError as e:
            results[process_id] = str(e)

    address, results, said = f"127.0.0.1:{_free_port()}", {}, []
    threads = [threading.Thread(target=run, args=(address, 3, i, 30, results, said)) for i in (2, 1, 0)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)  # the others wait (retrying) until process 0 listens
    for thread in threads:
        thread.join(timeout=60)
    assert results == {0: "go", 1: "go", 2: "go"}, results
    assert [m for i, m in said if i == 0][-1] == "all 3 processes joined; starting JAX's distributed runtime"
    assert any("joined: 3 of 3" in m for i, m in said if i == 0)

    address, results, said = f"127.0.0.1:{_free_port()}", {}, []
    start = time.monotonic()
    host = threading.Thread(target=run, args=(address, 2, 0, 3, results, said))
    host.start()
    run(address, 3, 1, 30, results, said)  # another --num-processes: refused at once, not after 30 s
    assert results[1] == ("process 0 runs with --num-processes 2, process 1 with 3: give every process the same "
                          "--num-processes") and time.monotonic() - start < 10
    host.join(timeout=30)
    assert results[0].startswith(f"only 1 of 2 processes joined at {address} within 3 s (missing: --process-id 1)")

    address, results, twice, said = f"127.0.0.1:{_free_port()}", {}, {}, []
    others = [threading.Thread(target=run, args=(address, 3, 0, 4, results, said)),
              threading.Thread(target=run, args=(address, 3, 1, 30, results, said))]
    for thread in others:
        thread.start()
        time.sleep(0.5)
    run(address, 3, 1, 30, twice, said)  # process id 1 again: refused at once
    assert twice[1] == "process id 1 has joined already: give each process its own --process-id"
    for thread in others:
        thread.join(timeout=30)
    assert results[0] == results[1] and results[0].startswith("only 2 of 3 processes joined")  # both told, alike
