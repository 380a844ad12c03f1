"""What MKL's strict conditional numerical reproducibility (MKL_CBWR=AUTO,STRICT, which `import parity` sets) costs
and buys on this CPU: the torch engine's generate (16 prompts x 8 samples, 16 tokens) and a trainer-sized forward and
backward (128 rows x 24 tokens), each timed in a fresh process with CNR off (MKL's default) and strict, with the
ratio; and whether a rollout split in two shards (as the Ray pool and the CPU lanes split it) equals the one-call
batch bit for bit under each (the sharding case of tests/test_cpu_lanes.py).

    python tests/bench/bench_mkl_cbwr.py            # ~1 minute on 2 cores

The tiny Qwen3 of the default experiment's shape, random weights (no download)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, sys, time
import torch
sys.path[:0] = [sys.argv[2], sys.argv[3]]
model = sys.argv[1]
from parity.core.sampling import SamplingSpec
from parity.rollout.sharding import global_spec, merge_batches, shard_prompts
from parity.rollout.torch_engine import TorchEngine
from transformers import AutoModelForCausalLM
assert os.environ["MKL_CBWR"] == sys.argv[4], (os.environ["MKL_CBWR"], sys.argv[4])  # parity keeps a value it finds
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (9, 7, 8, 12, 6, 10, 9, 11, 7, 8, 6, 9, 10, 8, 7, 12)]
spec = SamplingSpec(temperature=1.0, max_new_tokens=16, n=8, topk_logprobs=0, seed=3)
eng = TorchEngine(model, dtype=torch.float32, cpu_lanes=1)
eng.generate(prompts, spec)
t = time.perf_counter()
for _ in range(5):
    whole = eng.generate(prompts, spec)
gen = (time.perf_counter() - t) / 5
torch.set_num_threads(1)
# tests/test_cpu_lanes.py's sharding case: prompts of unequal lengths, two shards of 3
long = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (200, 61, 60, 140, 7, 99)]
spec = SamplingSpec(temperature=1.0, max_new_tokens=10, n=3, topk_logprobs=2, seed=7)
shared = global_spec(spec, long)
parts = [(s.start, eng.generate(long[s.start:s.stop], shared, prompt_ids=list(range(s.start, s.stop))))
         for s in shard_prompts(len(long), 2)]
merged = merge_batches(parts, eng.pad_id)
one = eng.generate(long, spec)
invariant = torch.equal(merged.rollout_logprobs, one.rollout_logprobs) and torch.equal(merged.responses, one.responses)
torch.set_num_threads(2)
m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
x = torch.randint(3, 60, (128, 24), generator=g)
opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
for i in range(6):
    if i == 1:
        t = time.perf_counter()
    loss = m(input_ids=x).logits.float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print(json.dumps({"generate_s": gen, "train_s": (time.perf_counter() - t) / 5, "shards_bit_equal": invariant}))
"""


def model_dir(root: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=2048, hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                      bos_token_id=2, tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).save_pretrained(root / "tiny")
    return root / "tiny"


def run(model: Path, cbwr: str) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "MKL_CBWR": cbwr}
    out = subprocess.run([sys.executable, "-c", CHILD, str(model), str(REPO / "platform"), str(REPO), cbwr],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def host() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(isa)}), {os.cpu_count()} cores"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp))
        # OFF: MKL's own default (no reproducibility mode); `import parity` keeps a value it finds
        res = {"OFF": run(model, "OFF"), "AUTO,STRICT": run(model, "AUTO,STRICT")}
    off, strict = res["OFF"], res["AUTO,STRICT"]
    print(f"host: {host()}")
    for name, r in res.items():
        print(f"MKL_CBWR={name:12s} generate {r['generate_s']:.3f} s  fwd+bwd {r['train_s']:.3f} s  "
              f"two shards == one call: {r['shards_bit_equal']}")
    print(f"strict / off: generate {strict['generate_s'] / off['generate_s']:.2f}x, "
          f"fwd+bwd {strict['train_s'] / off['train_s']:.2f}x")


if __name__ == "__main__":
    main()
