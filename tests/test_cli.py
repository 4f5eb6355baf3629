"""`jpaged generate`: bad input exits 2 with one line and no traceback; --json has the documented shape.

In-process tests reuse the session's loaded model (`load_model` is pointed at it) so the suite
loads the GGUF once; one subprocess test runs the real console script end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys

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
    (["hi", "--top-k", "-1"], "top_k"),
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
    (["hi", "--kv-cache-memory", "0GB"], "cannot read memory size '0GB'"),
    (["hi", "--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1, got 0"),
    (["hi", "--max-num-batched-tokens", "0"], "max_num_batched_tokens must be an integer >= 1"),
    (["hi", "--swap-space", "-1", "--preemption-mode", "swap"], "swap_space must be >= 0"),
    (["hi", "--num-blocks", "100000000"], "at most"),
    (["hi", "--kv-cache-memory", "1000TB"], "lower num_blocks / --num-blocks or kv_cache_memory"),
    (["hi", "--attention-backend", "pallas"], "use attention_backend='auto' or 'xla' here"),
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
                 ["--kv-cache-memory", "1TiB"], ["--n", "2"]):
        code, _, err = run_cli("hi", *argv)
        assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err


def test_several_processes_flags_are_checked_before_joining(run_cli, monkeypatch):
    from jpaged.device import distributed

    def no_join(*args, **kwargs):
        raise AssertionError("jax.distributed was joined before the flags were checked")

    monkeypatch.setattr(distributed, "initialize", no_join)
    for argv in (["--num-processes", "3", "--coordinator-address", "h:1", "--process-id", "-1"],
                 ["--num-processes", "2", "--coordinator-address", "h:1", "--max-tokens", "0"]):
        code, _, err = run_cli("hi", *argv)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--max-waiting", "0"], "max_waiting=0"),
    (["--grace-period", "-1"], "grace_period_s=-1"),
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
