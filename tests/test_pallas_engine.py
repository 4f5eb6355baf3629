"""The engine with the Pallas kernels (interpret mode on the CPU) gives the XLA path's greedy tokens."""

from __future__ import annotations

from jpaged import LLM, SamplingParams


def test_pallas_interpret_matches_xla_on_smollm2(default_model, alpaca_prompts):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("xla", "pallas"):
        llm = LLM(loaded=default_model, num_blocks=64, block_size=16, attention_backend=backend, interpret=True)
        prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in alpaca_prompts[:2]]
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
        assert llm.engine.runner.backend.name == backend
    assert tokens["pallas"] == tokens["xla"]
