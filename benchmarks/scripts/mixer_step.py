"""Step cost of FLA's pure models through specla, to compare two installed versions (the mixer-core
migration's before/after rows; BENCHMARKS.md, "Reproducing the runs", names their raw files).

    python benchmarks/scripts/mixer_step.py gdn|gla|mamba2 LABEL >> steps.jsonl

ms per step (median of 7 runs after a warm-up, prefill excluded) of specla's graph AR step and of
a SpecLA tree step (N 15, depth 6, the oracle drafter of ``benchmarks/e2e.py`` at the ``small``
target's GSM8K profile, no EAGLE head) at batches 1 and 32: FLA's GDN (GDN-1.3B shape), GLA
(hidden 2048, 24 layers, 4 heads) or Mamba2 (Mamba2-1.3B shape) with random bf16 weights and the
embedding trick of ``e2e.py``. The run's ``meta`` first (benchmarks/provenance.py), then one JSON line per row with the first 24 tokens of 3 sequences, for a
token comparison between the two runs. Put the version to measure first on ``PYTHONPATH``.
"""
import argparse, json, statistics, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e import TREE, ProfileDrafter, measured_profile
from provenance import add_allow_dirty, print_meta
from specla import SpecConfig, SpecDecoder
import fla  # noqa
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, GLAConfig, GLAForCausalLM, Mamba2Config, Mamba2ForCausalLM
ap = add_allow_dirty(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
ap.add_argument("plugin", choices=("gdn", "gla", "mamba2"))
ap.add_argument("label", help="names the installed version in every row")
a = ap.parse_args()
plugin, label = a.plugin, a.label
print_meta("cuda", a.allow_dirty)
torch.manual_seed(0)
if plugin == "gdn":
    model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=24, num_heads=8, head_dim=256, expand_v=1, tie_word_embeddings=False))
elif plugin == "gla":
    model = GLAForCausalLM(GLAConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=24, num_heads=4, tie_word_embeddings=False))
else:
    model = Mamba2ForCausalLM(Mamba2Config(vocab_size=32000, hidden_size=2048, num_hidden_layers=48, head_dim=64, state_size=128, expand=2, n_groups=1, tie_word_embeddings=False))
model = model.to("cuda", torch.bfloat16).eval()
emb = model.get_input_embeddings().weight
with torch.no_grad():
    emb.mul_(32); model.lm_head.weight.copy_(emb)
prof = measured_profile("benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json:gsm8k/eagle-tree")
for B in (1, 32):
    prompts = torch.randint(0, 32000, (B, 32), generator=torch.Generator().manual_seed(0)).tolist()
    for name, tree in (("AR", dict(num_draft_tokens=0)), ("tree", TREE)):
        c = SpecConfig(device="cuda", dtype="bfloat16", stop_at_eos=False, max_new_tokens=96,
                       engine=dict(budget_policy="fixed"), **tree)
        dec = SpecDecoder(model, plugin, drafter=ProfileDrafter(prof), config=c)
        dec.generate(prompts)
        ms = []
        for _ in range(7):
            r = dec.generate(prompts); ms.append((r.stats.wall_s - r.stats.prefill_s) / r.stats.steps * 1e3)
        print(json.dumps(dict(plugin=plugin, label=label, B=B, row=name, ms_per_step=round(statistics.median(ms), 4),
                              accepted=round(r.stats.mean_accepted_tokens, 3), outputs=[o[:24] for o in r.outputs[:3]])), flush=True)
