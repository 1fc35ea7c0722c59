"""Fixture checkpoints: byte-identical rebuilds in separate processes, a hash that follows the
inputs, one build under three concurrent real processes, no half fixture after SIGKILL, the
config fields and tensor shapes vLLM reads, and the known-answer designs checked with plain
torch (and transformers' own model classes) on the built weights."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from safetensors import safe_open

from specgate.core.manifest import REPO_ROOT, Fixture, load
from specgate.vllmside import fixtures, knownanswer
from specgate.vllmside.fixtures import EOS_ID, MASK_ID, VOCAB

if TYPE_CHECKING:   # torch: imported by the tests that run, not by collecting the fast tier
    import torch

CLI = [sys.executable, "-m", "specgate.vllmside.fixtures"]


def _cli(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECGATE_CACHE_DIR": str(cache)}
    return subprocess.run([*CLI, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def _paths(result: subprocess.CompletedProcess) -> dict[str, Path]:
    assert result.returncode == 0, result.stderr
    return {name: Path(path) for name, path in (line.split("\t") for line in result.stdout.splitlines())}


def _digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fixture-cache-a")


@pytest.fixture(scope="module")
def built(cache) -> dict[str, Path]:
    """Every manifest fixture, built once by the CLI in its own process."""
    return _paths(_cli(cache, "--print-paths"))


@pytest.fixture
def use_cache(cache, monkeypatch) -> Path:
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(cache))
    return cache


def _by_kind(built: dict[str, Path], kind: str) -> Path:
    name = next(n for n, f in load().fixtures.items() if f.kind == kind)
    return built[name]


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


# ---------------------------------------------------------------------------
# Determinism, hashing, cache behaviour
# ---------------------------------------------------------------------------

def test_manifest_covers_every_kind():
    assert {f.kind for f in load().fixtures.values()} == set(fixtures.FIXTURE_KINDS)


@pytest.mark.vllm
def test_rebuild_in_another_process_and_cache_is_byte_identical(built, tmp_path):
    again = _paths(_cli(tmp_path / "cache-b", "--print-paths"))
    assert again.keys() == built.keys()
    for name, path in built.items():
        assert again[name].name == path.name, "same inputs, same hash"
        assert again[name] != path
        assert _digests(again[name]) == _digests(path), name
        assert {"config.json", "model.safetensors", "tokenizer.json", "fixture.json"} <= set(_digests(path))


def test_hash_follows_kind_params_and_source(tmp_path, monkeypatch):
    base = Fixture("x", "qwen3-random", {})
    assert fixtures.fixture_hash(base) == fixtures.fixture_hash(Fixture("y", "qwen3-random", {"seed": 0}))
    assert fixtures.fixture_hash(base) != fixtures.fixture_hash(Fixture("x", "qwen3-random", {"seed": 1}))
    assert fixtures.fixture_hash(base) != fixtures.fixture_hash(Fixture("x", "qwen3-context", {}))
    before = fixtures.fixture_hash(base)
    for index, source in enumerate(fixtures.SOURCES):     # the builders and the known-answer kernel
        edited = tmp_path / source.name
        edited.write_text(source.read_text() + "\n# edited\n")
        sources = list(fixtures.SOURCES)
        sources[index] = edited
        monkeypatch.setattr(fixtures, "SOURCES", tuple(sources))
        assert fixtures.fixture_hash(base) != before, source.name
        monkeypatch.undo()


@pytest.mark.parametrize("fixture, message", [
    (Fixture("f", "no-such-kind", {}), "unknown kind 'no-such-kind'"),
    (Fixture("f", "qwen3-random", {"sed": 1}), "unknown param(s) sed"),
    (Fixture("f", "qwen3-random", {"seed": "1"}), "param 'seed' must be int"),
])
def test_bad_fixture_entries_fail_in_one_line(fixture, message):
    with pytest.raises(fixtures.FixtureError) as info:
        fixtures.fixture_hash(fixture)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("command", [CLI, [sys.executable, str(REPO_ROOT / "scripts" / "build_fixtures.py")]])
def test_cli_rejects_an_unknown_name_with_exit_2(command, tmp_path):
    env = {**os.environ, "SPECGATE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([*command, "--only", "tiny-qwen3", "no-such-fixture"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"specgate.fixtures: unknown fixture 'no-such-fixture' (known: {', '.join(sorted(load().fixtures))})"]
    assert not list((tmp_path / "fixtures").glob("tiny-qwen3-*")), "nothing is built when a name is bad"


# A child process that counts its builder calls in a shared file, signals that it is building,
# and waits for a start file so that all children call ensure() at the same moment.
CHILD = """
import os, sys, time
from pathlib import Path
from specgate.vllmside import fixtures, knownanswer
from specgate.core.manifest import load
kind, log, start, hold = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4])
real = fixtures.FIXTURE_KINDS[kind]
def counted(params):
    with log.open("a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(hold)
    return real(params)
fixtures.FIXTURE_KINDS[kind] = counted
while not start.exists():
    time.sleep(0.01)
print(fixtures.ensure(load(), "tiny-qwen3"))
"""


def _child(tmp_path: Path, cache: Path, hold: float) -> subprocess.Popen:
    env = {**os.environ, "SPECGATE_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-c", CHILD, "qwen3-random", str(tmp_path / "builds.log"),
                             str(tmp_path / "start"), str(hold)], env=env, stdout=subprocess.PIPE, text=True)


@pytest.mark.vllm
def test_three_concurrent_processes_build_once(tmp_path):
    cache = tmp_path / "cache"
    children = [_child(tmp_path, cache, hold=1.0) for _ in range(3)]
    time.sleep(0.5)
    (tmp_path / "start").touch()
    outputs = [c.communicate(timeout=300)[0].strip() for c in children]
    assert [c.returncode for c in children] == [0, 0, 0]
    assert len(set(outputs)) == 1
    assert len((tmp_path / "builds.log").read_text().splitlines()) == 1
    folder = Path(outputs[0])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in folder.iterdir()}
    assert not list(folder.parent.glob(".*.tmp*"))


@pytest.mark.vllm
def test_sigkilled_build_leaves_no_fixture_and_the_next_ensure_recovers(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    (tmp_path / "start").touch()
    child = _child(tmp_path, cache, hold=60.0)
    deadline = time.monotonic() + 120
    while not (tmp_path / "builds.log").exists():
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(cache))
    manifest = load()
    final = fixtures.fixture_dir(manifest, "tiny-qwen3")
    assert not final.exists()
    assert list(final.parent.glob(f".{final.name}.tmp*")), "the killed build's temporary folder is left"
    assert fixtures.ensure(manifest, "tiny-qwen3") == final
    assert (final / "model.safetensors").is_file()
    assert not list(final.parent.glob(f".{final.name}.tmp*")), "ensure() cleared it under the lock"


@pytest.mark.vllm
def test_a_damaged_fixture_is_rebuilt_before_use_never_served(tmp_path, monkeypatch, capsys):
    """A job killed mid-write or a full disk leaves a short file: every use checks the sizes and
    rebuilds; a changed byte of the same size is found where full hashing runs (warm_cache)."""
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path / "cache"))
    manifest = load()
    path = fixtures.ensure(manifest, "tiny-qwen3")
    good = _digests(path)
    assert json.loads((path / fixtures.DIGESTS).read_text()) == fixtures.file_digests(path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])   # truncated to half
    assert fixtures.ensure(manifest, "tiny-qwen3") == path and _digests(path) == good
    assert f"model.safetensors has {len(weights.read_bytes()) // 2} bytes" in capsys.readouterr().err

    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF                                                            # same size, one byte changed
    weights.write_bytes(bytes(data))
    assert fixtures.ensure(manifest, "tiny-qwen3") == path and _digests(path) != good   # a use: sizes only
    assert fixtures.ensure(manifest, "tiny-qwen3", full=True) == path and _digests(path) == good
    assert "does not match the sha256 it had when built" in capsys.readouterr().err
    (path / fixtures.DIGESTS).unlink()                                          # built before digests existed
    assert fixtures.ensure(manifest, "tiny-qwen3") == path and _digests(path) == good
    assert not list(path.parent.glob(f".{path.name}.tmp*"))                     # the damaged folder is gone


@pytest.mark.vllm
def test_describe_reports_facts_and_the_known_answer_rule(built, use_cache):
    manifest = load()
    for name, path in built.items():
        info = fixtures.describe(manifest, name)
        assert info["path"] == path and info["name"] == name
        assert info["hash"] == path.name.rsplit("-", 1)[1] == fixtures.fixture_hash(manifest.fixtures[name])
        assert info["kind"] == manifest.fixtures[name].kind and info["vocab_size"] == VOCAB
        if info["role"] == "target":
            assert info["known_answer"] == (knownanswer.CONTEXT_RULE if info["kind"].endswith("-context") else None)
    dflash = fixtures.describe(manifest, "dflash-successor")
    assert dflash["mask_token_id"] == MASK_ID and dflash["aux_layer_ids"] == [1]   # the context target's one layer
    assert dflash["target_shape"]["num_hidden_layers"] == fixtures.CONTEXT_LAYERS == 1
    assert dflash["max_speculative_tokens"] == 5
    assert fixtures.describe(manifest, "eagle3-random")["aux_layer_ids"] == [0, 1, 2]
    assert fixtures.describe(manifest, "tiny-qwen3")["speculative_method"] == "ngram"


# ---------------------------------------------------------------------------
# What vLLM reads
# ---------------------------------------------------------------------------

@pytest.mark.vllm
def test_tokenizer_covers_every_id_and_round_trips_text(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built["tiny-qwen3"]))
    assert len(tok) == VOCAB
    assert tok.eos_token_id == EOS_ID and tok.convert_tokens_to_ids("<|mask|>") == MASK_ID
    text = "the cat sat on the mat. 1 2 3 hello, world!"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and max(ids) < EOS_ID
    assert all(isinstance(tok.decode([i]), str) for i in range(VOCAB))


@pytest.mark.vllm
def test_target_configs(built):
    for kind, arch in [("qwen3-random", "Qwen3ForCausalLM"), ("qwen3-context", "Qwen3ForCausalLM"),
                       ("mimo-mtp-random", "MiMoForCausalLM"), ("mimo-mtp-context", "MiMoForCausalLM"),
                       ("qwen35-mtp-random", "Qwen3_5ForCausalLM")]:
        config = _config(_by_kind(built, kind))
        assert config["architectures"] == [arch], kind
        assert config["vocab_size"] == VOCAB
        assert config["hidden_size"] == (fixtures.MIMO_CONTEXT_HIDDEN if kind == "mimo-mtp-context" else 512)
        # vLLM's Qwen2 (MiMo) derives head_dim from hidden_size / heads and ignores config.head_dim.
        assert config["hidden_size"] // config["num_attention_heads"] == 64 or arch != "MiMoForCausalLM"
        assert config["head_dim"] == 64
        assert config["max_position_embeddings"] == 2048 and config["tie_word_embeddings"] is False
        assert config["dtype"] == "bfloat16" and config["eos_token_id"] == EOS_ID
    assert _config(_by_kind(built, "mimo-mtp-random"))["num_nextn_predict_layers"] == 1
    qwen35 = _config(_by_kind(built, "qwen35-mtp-random"))
    assert qwen35["model_type"] == "qwen3_5_text" and qwen35["mtp_num_hidden_layers"] == 1
    assert qwen35["layer_types"] == ["linear_attention", "full_attention"]


@pytest.mark.vllm
def test_mtp_weights_sit_next_to_the_body(built):
    for kind in ("mimo-mtp-random", "mimo-mtp-context"):
        names = set(_tensors(_by_kind(built, kind)))
        mtp = {n.removeprefix("model.mtp_layers.0.") for n in names if n.startswith("model.mtp_layers.0.")}
        assert {"token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
                "final_layernorm.weight",
                "self_attn.q_proj.bias", "self_attn.o_proj.weight", "mlp.down_proj.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight"} <= mtp
    with safe_open(str(_by_kind(built, "qwen35-mtp-random") / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("mtp.fc.weight").get_shape() == [512, 1024]
    assert {"mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight",
            "model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.A_log"} <= names


@pytest.mark.vllm
def test_qwen35_loads_in_transformers_with_no_missing_weights(built):
    import torch
    from transformers import Qwen3_5ForCausalLM

    model, info = Qwen3_5ForCausalLM.from_pretrained(str(_by_kind(built, "qwen35-mtp-random")),
                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.vllm
def test_draft_configs_and_shapes(built):
    import torch

    # The random drafts fit the two-layer random targets, the successor drafts the one-layer context targets.
    for kind, aux in (("eagle3-random", [0, 1, 2]), ("eagle3-successor", [0, 1])):
        folder = _by_kind(built, kind)
        config, tensors = _config(folder), _tensors(folder)
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == aux
        assert config["draft_vocab_size"] == VOCAB and config["target_hidden_size"] == 512
        assert tensors["fc.weight"].shape == (512, len(aux) * 512)
        assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 512
        assert tensors["lm_head.weight"].shape == (VOCAB, 512)
        assert not any("embed_tokens" in n for n in tensors), "shared from the target"
    for kind, layers in (("dflash-random", [0, 1]), ("dflash-successor", [0])):
        folder = _by_kind(built, kind)
        config, tensors = _config(folder), _tensors(folder)
        assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
        assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": layers}
        assert tensors["fc.weight"].shape == (512, len(layers) * 512)
        assert not any("embed_tokens" in n or "lm_head" in n for n in tensors), "shared from the target"
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())


# ---------------------------------------------------------------------------
# Known answers, on the built bf16 weights
# ---------------------------------------------------------------------------

CONTEXT_PROMPTS = [[5, 6, 7], [42], [300, 200], [509, 510], list(range(100, 160)) + [100, 101],
                   [7, 300, 9, 301, 7, 300, 9]]
CONTEXT_LENGTH = 512      # positions checked per prompt (the e2e prompts reach about 140)


def _context_model(built: dict[str, Path], kind: str):
    import torch
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

    cls = {"qwen3-context": Qwen3ForCausalLM, "mimo-mtp-context": Qwen2ForCausalLM}[kind]
    return cls.from_pretrained(str(_by_kind(built, kind)), dtype=torch.bfloat16, attn_implementation="eager")


def _answers(model, seq: list[int], mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits at every position of `seq` (bf16 weights), under a boolean [L, L] mask of the keys
    each query may see (default: causal)."""
    import torch

    ids = torch.tensor([seq])
    if mask is None:
        return model(ids).logits[0].float()
    additive = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(~mask, torch.finfo(torch.bfloat16).min)
    return model(ids, attention_mask=additive[None, None]).logits[0].float()


@pytest.mark.parametrize("kind", ["qwen3-context", "mimo-mtp-context"])
@pytest.mark.vllm
def test_context_targets_follow_their_rule_exactly_in_bf16(built, kind):
    """Long sequences: at every position the analytic answer x[t-1] + 2 wins by sqrt(512) logits."""
    import torch

    model = _context_model(built, kind)
    for prompt in CONTEXT_PROMPTS:
        seq = prompt + knownanswer.continuation(knownanswer.CONTEXT_RULE, prompt, CONTEXT_LENGTH - len(prompt), VOCAB)
        logits = _answers(model, seq)[:-1]
        assert logits.argmax(-1).tolist() == [(seq[max(t - 1, 0)] + 2) % VOCAB for t in range(len(seq) - 1)]
        top2 = logits.topk(2).values
        assert (top2[:, 0] - top2[:, 1]).min() > 20, "the answer wins by sqrt(512) = 22.6 logits"
        out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
        assert out.tolist() == seq[len(prompt):len(prompt) + 16]


@pytest.mark.parametrize("name", ["context-qwen3-spread", "mimo-mtp-spread"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.vllm
def test_spread_targets_give_the_logits_their_facts_name_in_each_dtype(built, name, dtype):
    """The sampling checks' design, per engine dtype: bf16 rounds the logits onto the spread;
    float32 keeps the bf16-stored head's products (at H = 512 their gaps to the answer's logit are
    up to 0.06 off the spread's). Compared as those gaps, which are what the distribution depends
    on: HF's float32 forward lands within 0.008 of the facts, vLLM's within 1e-4."""
    import torch
    from transformers import AutoModelForCausalLM

    want = torch.tensor(json.loads((built[name] / "fixture.json").read_text())["answer_logits"][dtype])
    model = AutoModelForCausalLM.from_pretrained(str(built[name]), dtype=getattr(torch, dtype),
                                                 attn_implementation="eager")
    prompt = [5, 6, 7]
    seq = prompt + knownanswer.continuation(knownanswer.CONTEXT_RULE, prompt, 61, VOCAB)
    logits = _answers(model, seq)
    offsets = torch.arange(len(want))
    for t in range(len(seq)):
        got = logits[t, (seq[max(t - 1, 0)] + 2 + offsets) % VOCAB]
        gaps, want_gaps = got - got[0], want - want[0]
        assert (gaps - want_gaps).abs().max() < 0.01, f"position {t}: gaps {gaps.tolist()}, facts {want_gaps.tolist()}"


def _block_masks(length: int, block: int) -> dict[str, torch.Tensor]:
    """Attention faults of a verification step, applied to every block of `block` queries."""
    import torch

    causal = torch.ones(length, length).tril().bool()
    pos = torch.arange(length)
    same_block = (pos[:, None] // block) == (pos[None, :] // block)
    return {
        "non-causal inside the block": causal | same_block,
        "previous key missing inside the block": causal & ~(same_block & (pos[:, None] - pos[None, :] == 1)),
        "own key missing inside the block": causal & ~(same_block & (pos[:, None] == pos[None, :])
                                                       & (pos[:, None] % block != 0)),
    }


@pytest.mark.parametrize("kind", ["qwen3-context", "mimo-mtp-context"])
@pytest.mark.vllm
def test_breaking_attention_changes_the_context_targets_answer(built, kind):
    """A fault confined to blocks of 4 queries (a k = 3 verification step) changes the answer
    at most positions of every prompt, a successor chain included; the causal run does not."""
    model = _context_model(built, kind)
    for prompt in CONTEXT_PROMPTS:
        seq = prompt + knownanswer.continuation(knownanswer.CONTEXT_RULE, prompt, 128 - len(prompt), VOCAB)
        right = _answers(model, seq).argmax(-1)
        assert right[:-1].tolist() == [(seq[max(t - 1, 0)] + 2) % VOCAB for t in range(len(seq) - 1)]
        for fault, mask in _block_masks(len(seq), 4).items():
            changed = (_answers(model, seq, mask).argmax(-1) != right).float().mean().item()
            assert changed > 0.2, f"{kind}, prompt {prompt[:4]}: {fault} changed only {changed:.0%} of the answers"


@pytest.mark.vllm
def test_context_kernel_margins_hold_on_the_built_weights(built):
    """The scores the built bf16 q/k weights give, through RoPE, are the documented kernel: the
    previous-token head's best key is d = 1, the self head's best causal key is d = 0 and its
    best key overall d = -1, each by the documented margin (in softmax logits)."""
    import torch

    w = _tensors(_by_kind(built, "qwen3-context"))
    attn = "model.layers.0.self_attn."
    x = math.sqrt(VOCAB) * torch.eye(VOCAB, dtype=torch.bfloat16)[7:8]            # any token: content-free
    q = _rms((x @ w[f"{attn}q_proj.weight"].T).unflatten(-1, (16, 64)), w[f"{attn}q_norm.weight"])[0]
    k = _rms((x @ w[f"{attn}k_proj.weight"].T).unflatten(-1, (8, 64)), w[f"{attn}k_norm.weight"])[0]
    distances = torch.arange(-1, 1025)
    base = 1200                                                              # query position
    qr = _neox_rope(q[None].expand(len(distances), -1, -1), torch.full((len(distances),), base),
                    knownanswer.ROPE_THETA)
    kr = _neox_rope(k[None].expand(len(distances), -1, -1), base - distances, knownanswer.ROPE_THETA)
    scores = torch.einsum("dhx,dhx->hd", qr.float(), kr.repeat_interleave(2, dim=1).float()) / 8.0
    prev, own = scores[0], scores[1]
    margin = fixtures.CONTEXT_SCORE_MARGIN
    at = {int(d): i for i, d in enumerate(distances)}
    assert prev[at[1]] - torch.cat([prev[:at[1]], prev[at[1] + 1:]]).max() > 0.9 * margin
    assert own[at[0]] - own[at[1]:].max() > 0.9 * margin and own[at[-1]] - own[at[0]] > 0.9 * margin
    assert min(knownanswer.margins()) > 0.2 and all(s.isfinite().all() for s in (prev, own))


@pytest.mark.parametrize("kind", ["qwen3-random", "mimo-mtp-random", "qwen35-mtp-random"])
@pytest.mark.vllm
def test_random_targets_follow_their_planted_map_with_a_wide_margin(built, kind):
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForCausalLM, Qwen3_5ForCausalLM, Qwen3ForCausalLM

    folder = _by_kind(built, kind)
    cls = {"qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3_5_text": Qwen3_5ForCausalLM}[
        AutoConfig.from_pretrained(str(folder)).model_type]
    planted = json.loads((folder / "fixture.json").read_text())["planted_next_token"]
    assert set(planted) <= set(fixtures.LOOP_TOKENS)
    model = cls.from_pretrained(str(folder), dtype=torch.bfloat16)
    prompt = AutoTokenizer.from_pretrained(str(folder)).encode("the cat sat on the mat. the cat sat")
    out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0].tolist()
    chain = [out[len(prompt) - 1]]
    for _ in range(24):
        chain.append(planted[chain[-1]])
    assert out[len(prompt):] == chain[1:]
    logits = model(torch.tensor([out])).logits[0, len(prompt) - 1:-1].float()
    top2 = logits.topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 10.0, "no rounding difference can flip the argmax"
    assert len(set(out[-8:])) < 8, "greedy decoding has fallen into a loop"


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    import torch

    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)


@pytest.mark.vllm
def test_eagle3_successor_moves_one_token_per_step(built):
    """vLLM's EAGLE-3 layer (norm_before_residual, attention output zero) on every token."""
    import torch

    w = _tensors(_by_kind(built, "eagle3-successor"))
    tokens = torch.arange(VOCAB)
    onehot = torch.eye(VOCAB, dtype=torch.bfloat16)
    aux = len(fixtures.EAGLE3_CONTEXT_AUX_LAYERS)
    hidden = torch.cat([onehot] * aux, dim=1) @ w["fc.weight"].T          # aux states are e(t)
    for step in range(1, 4):
        residual = _rms(hidden, w["midlayer.hidden_norm.weight"])
        x = _rms(residual, w["midlayer.post_attention_layernorm.weight"])
        gate, up = x @ w["midlayer.mlp.gate_proj.weight"].T, x @ w["midlayer.mlp.up_proj.weight"].T
        act = torch.nn.functional.silu(gate) * up
        hidden = residual + act @ w["midlayer.mlp.down_proj.weight"].T     # fed to the next step
        logits = _rms(hidden, w["norm.weight"]) @ w["lm_head.weight"].T
        assert torch.equal(logits.argmax(-1), (tokens + step + 1) % VOCAB), f"draft step {step}"


@pytest.mark.vllm
def test_mimo_mtp_context_layer_proposes_the_successor(built):
    """At position i the MTP layer gets embed(t_{i+1}) and the target's hidden state there,
    e(t_{i+1}) (the context rule); it proposes t_{i+1} + 1 through the identity lm_head, with
    or without the embedding (MiMo zeroes it at position 0), and not from a shifted state."""
    import torch

    w = _tensors(_by_kind(built, "mimo-mtp-context"))
    mtp = "model.mtp_layers.0."
    tokens = torch.arange(VOCAB)
    embeds = w["model.embed_tokens.weight"][(tokens + 1) % VOCAB]          # embed(t_{i+1})
    hidden = embeds / fixtures.CONTEXT_EMBED                                # target state at i: e(t_{i+1})
    for position_zero, state in ((False, hidden), (True, hidden), (False, hidden.roll(1, 0))):
        e = torch.zeros_like(embeds) if position_zero else embeds
        x = torch.cat([_rms(state, w[f"{mtp}hidden_layernorm.weight"]),
                       _rms(e, w[f"{mtp}token_layernorm.weight"])], 1)
        h = x @ w[f"{mtp}input_proj.weight"].T          # the MTP block adds zero (o_proj, down_proj = 0)
        assert not w[f"{mtp}self_attn.o_proj.weight"].any() and not w[f"{mtp}mlp.down_proj.weight"].any()
        logits = _rms(h, w[f"{mtp}final_layernorm.weight"]) @ w["lm_head.weight"].T
        right = torch.equal(logits.argmax(-1), (tokens + 2) % VOCAB)
        assert right == (state is hidden), "the hidden half decides: a shifted hidden state shows in the draft"


def _neox_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    import torch

    half = x.shape[-1] // 2
    inv_freq = 1.0 / base ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half))
    angles = positions.float()[:, None] * inv_freq
    cos, sin = angles.cos().to(x.dtype)[:, None, :], angles.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("target_name", ["context-qwen3", "context-qwen3-spread"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("start", [1, 37, 500])
@pytest.mark.vllm
def test_dflash_successor_slot_j_drafts_bonus_plus_j(built, k, start, target_name):
    """vLLM's DFlash query pass on the built weights, for every bonus token x at once: the block
    [x, mask * k] at positions start..start+k attends to itself and to `start` context
    positions whose keys and values are zero (fc = 0). The same under the spread target's
    lm_head, which also scores a + j for every residual dim a: the drafts stay exact."""
    import torch

    w = _tensors(_by_kind(built, "dflash-successor"))
    target = _tensors(built[target_name])     # DFlash shares its embedding and lm_head
    target_lm_head = target["lm_head.weight"]
    config = _config(_by_kind(built, "dflash-successor"))
    heads, kv_heads, layer = config["num_attention_heads"], config["num_key_value_heads"], "layers.0.self_attn."
    ids = torch.cat([torch.arange(VOCAB)[:, None], torch.full((VOCAB, k), MASK_ID)], dim=1)   # [x, mask...]
    residual = target["model.embed_tokens.weight"][ids]                                     # [V, k+1, H]
    x = _rms(residual, w["layers.0.input_layernorm.weight"])
    q = (x @ w[f"{layer}q_proj.weight"].T).unflatten(-1, (heads, 64))
    kk = (x @ w[f"{layer}k_proj.weight"].T).unflatten(-1, (kv_heads, 64))
    v = (x @ w[f"{layer}v_proj.weight"].T).unflatten(-1, (kv_heads, 64))
    positions = torch.arange(start, start + k + 1)
    q = torch.stack([_neox_rope(_rms(q[b], w[f"{layer}q_norm.weight"]), positions) for b in range(VOCAB)])
    kk = torch.stack([_neox_rope(_rms(kk[b], w[f"{layer}k_norm.weight"]), positions) for b in range(VOCAB)])
    group = heads // kv_heads
    kk, v = kk.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk.float()) / 8.0
    context = torch.zeros(VOCAB, heads, k + 1, start)                   # zero keys score 0
    probs = torch.cat([scores, context], dim=-1).softmax(-1)[..., : k + 1]
    attn = torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).flatten(2).to(torch.bfloat16)
    hidden = residual + attn @ w[f"{layer}o_proj.weight"].T              # MLP output is zero
    assert not w["layers.0.mlp.down_proj.weight"].any() and not w["fc.weight"].any()
    logits = _rms(hidden, w["norm.weight"]).float() @ target_lm_head.float().T
    drafted = logits.argmax(-1)[:, 1:]                                   # mask slots 1..k
    expected = (torch.arange(VOCAB)[:, None] + torch.arange(1, k + 1)) % VOCAB
    assert torch.equal(drafted, expected)
    top2 = logits[:, 1:].topk(2, dim=-1).values
    # The spread head's own margin is 0.5 (a over a + 1); the identity head's is tens of logits.
    assert (top2[..., 0] - top2[..., 1]).min() > (0.4 if target_name.endswith("-spread") else 1.0)


def test_dflash_kernel_margin_is_what_the_builder_documents():
    const, margin = fixtures.dflash_kernel(5)
    assert 0 < margin < const < 1
    f = [sum(a * math.cos(d * fixtures._rope_freq(i)) for i, a in fixtures.DFLASH_KERNEL.items()) - const
         for d in range(-9, 10)]
    assert f[9] == pytest.approx(margin) and max(f[:9] + f[10:]) == pytest.approx(-margin)
