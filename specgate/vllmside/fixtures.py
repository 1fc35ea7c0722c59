"""Fixture checkpoints: tiny deterministic models that vLLM 0.32 loads on CPU.

A fixture is a manifest entry ``[fixtures.NAME] kind = "..."`` plus optional params. Its
builder (FIXTURE_KINDS[kind]) is a pure function of those params: weights come from a seeded
torch.Generator or are set by hand, keys are written in sorted order, nothing reads the clock.
So two builds of one fixture are byte-identical. A build takes seconds and writes config.json,
model.safetensors, a 512-token byte-level BPE tokenizer and fixture.json (the facts tests read)
into ``cache_root()/fixtures/NAME-HASH``; HASH covers the builders' sources (this file and
specgate.knownanswer), the kind, the params and the versions of the libraries that produce the
bytes, so any change means a new folder.

Every model shares one shape so that any draft pairs with any target: vocabulary V = 512,
hidden size 512, heads of dimension 64 (CPU attention rejects 16), two target layers. The
exceptions are the context targets, which have the one layer their design reads through
(CONTEXT_LAYERS; the successor drafts that pair with them take their aux states from it), and
the MiMo context target, 1024 wide (MIMO_CONTEXT_HIDDEN), whose only draft is its own MTP layer.

Known-answer fixtures have weights set by hand. The "context" targets continue a prompt by
reading the previous token through attention (specgate.knownanswer: x[t-1] + 2), so a fault in
the verification step's attention, positions or KV cache changes their output; the
"successor" drafts propose (t + 1) chains, exact where the target's answer is such a chain and
wrong at known positions elsewhere. The designs are documented at each builder; weights a
design does not need stay random (outputs it must not see are zeroed), so the kernels still
compute on real numbers and a NaN anywhere would still reach the logits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from specgate.core.manifest import Fixture, Manifest, ManifestError, load
from specgate.core.paths import cache_root
from specgate.vllmside import knownanswer

VOCAB = 512
HIDDEN = 512
HEAD_DIM = 64
TARGET_LAYERS = 2
MAX_POSITIONS = 2048          # upstream's ngram test reads only max_model_len from its config
EOS_ID = 510                  # "<|endoftext|>"
MASK_ID = 511                 # "<|mask|>", DFlash's mask slot token
SPECIAL_TOKENS = ("<|endoftext|>", "<|mask|>")
BYTES_LIBRARIES = ("torch", "safetensors", "tokenizers", "transformers")
SOURCES = (Path(__file__), Path(knownanswer.__file__))   # the bytes follow both
EMBED = "model.embed_tokens.weight"


class FixtureError(ManifestError):
    """A fixture the manifest names but the builder cannot make; str() is one line."""


@dataclass
class Built:
    """What a builder returns: config.json, the tensors, and facts for describe()."""

    config: dict[str, Any]
    tensors: dict[str, Any]
    facts: dict[str, Any] = field(default_factory=dict)


FIXTURE_KINDS: dict[str, Callable[[dict[str, Any]], Built]] = {}
_DEFAULT_PARAMS: dict[str, dict[str, Any]] = {}


def _kind(name: str, **defaults: Any) -> Callable:
    def register(builder: Callable[[dict[str, Any]], Built]) -> Callable[[dict[str, Any]], Built]:
        FIXTURE_KINDS[name] = builder
        _DEFAULT_PARAMS[name] = defaults
        return builder
    return register


# ---------------------------------------------------------------------------
# Tokenizer: byte-level BPE with exactly VOCAB ids, so every id decodes.
# ---------------------------------------------------------------------------

def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value, indexed by the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _tokenizer_files() -> dict[str, str]:
    """256 byte tokens, 254 fixed merges (common English letter pairs), then the specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_chars()
    space = chars[ord(" ")]
    letters = "etaoinshrdlu"
    pairs = [a + b for a in letters for b in letters]
    merges = [(space, c) for c in "abcdefghijklmnopqrstuvwxyz"]
    merges += [(p[0], p[1]) for p in pairs]
    merges += [(space + p[0], p[1]) for p in pairs]
    merges = merges[: VOCAB - 256 - len(SPECIAL_TOKENS)]
    vocab = {c: i for i, c in enumerate(chars)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tokenizer.get_vocab_size() == VOCAB and tokenizer.token_to_id(SPECIAL_TOKENS[1]) == MASK_ID
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    }
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2, sort_keys=True) + "\n",
    }


# ---------------------------------------------------------------------------
# Tensor helpers
# ---------------------------------------------------------------------------

def _hf_shapes(model_cls: Any, config: Any) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes exactly as transformers' model class names them."""
    import torch

    with torch.device("meta"):
        model = model_cls(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _randomize(shapes: dict[str, tuple[int, ...]], seed: int, std: float = 0.02,
               norm_value: float = 1.0, stds: dict[str, float] | None = None) -> dict[str, Any]:
    """Seeded normal matrices (std, or stds[name]); vectors get the values their modules are
    built with: norms norm_value (0 for the (1 + w) RMSNorm of Qwen3.5), GDN decay log(1..n)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("A_log"):
            out[name] = torch.log(torch.arange(1, shape[0] + 1, dtype=torch.float32))
        elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
            out[name] = torch.ones(shape)
        elif "norm" in name:
            out[name] = torch.full(shape, norm_value)
        else:
            out[name] = torch.randn(shape, generator=gen) * (stds or {}).get(name, std)
    return out


def _token_map(hidden: int, shift: int = 0):
    """[hidden, hidden]: token t's dimension (the first V of the residual) to t + shift mod V."""
    import torch

    out = torch.zeros(hidden, hidden)
    out[:VOCAB, :VOCAB] = torch.roll(torch.eye(VOCAB), shifts=shift, dims=0)
    return out


def _bf16(tensors: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}


# ---------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1024, num_attention_heads=8,
    num_key_value_heads=4, head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITIONS,
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=EOS_ID,
    pad_token_id=EOS_ID, dtype="bfloat16", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def _qwen3_config(**overrides: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**{**_COMMON, "num_hidden_layers": TARGET_LAYERS,
                          "architectures": ["Qwen3ForCausalLM"], **overrides})


def _target_facts(config: Any, method: str | None = None) -> dict[str, Any]:
    return {
        "role": "target", "architecture": config.architectures[0], "model_type": config.model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "max_position_embeddings": config.max_position_embeddings,
        "eos_token_id": EOS_ID, "known_answer": None, "speculative_method": method,
    }


def _draft_facts(config: dict[str, Any], method: str, aux_layer_ids: list[int], successor: bool,
                 target_layers: int = TARGET_LAYERS, **extra: Any) -> dict[str, Any]:
    return {
        "role": "draft", "architecture": config["architectures"][0], "model_type": config["model_type"],
        "vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
        "speculative_method": method, "aux_layer_ids": aux_layer_ids, "successor": successor,
        "target_shape": {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": target_layers},
        **extra,
    }


def _config_dict(config: Any) -> dict[str, Any]:
    return json.loads(config.to_json_string(use_diff=False))


# ---------------------------------------------------------------------------
# Qwen3 targets
# ---------------------------------------------------------------------------

# Random targets carry a planted random map next(t): the embedding is a random orthogonal matrix
# (rows of norm sqrt(H)), and the lm_head is random (std 0.25) plus 2 * e(next(t)) (x) embed(t) /
# sqrt(H). After the final RMSNorm, token t's hidden state gives next(t) a logit of about
# 2 sqrt(H) = 45 over a random background of std 0.25 sqrt(H) = 5.7, a margin no bf16 rounding
# difference between batch shapes can flip, so greedy outputs with and without a draft agree.
# The layers are random and weak (std 0.02): they compute on real numbers without moving the
# argmax. next(t) is drawn from 32 printable characters, so every prompt falls into a short loop
# within a few tokens (the ngram proposer drafts and gets accepts).
LOOP_TOKENS = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz .,!?'"]


def _random_target(shapes: dict[str, tuple[int, ...]], seed: int,
                   norm_value: float = 1.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A random target's tensors, and its planted map as a fact."""
    import torch

    tensors = _randomize({k: v for k, v in shapes.items() if k != EMBED}, seed, norm_value=norm_value,
                         stds={"lm_head.weight": 0.25})
    gen = torch.Generator().manual_seed(seed)
    embed = torch.linalg.qr(torch.randn(VOCAB, HIDDEN, generator=gen))[0] * math.sqrt(HIDDEN)
    planted = torch.tensor(LOOP_TOKENS)[torch.randint(len(LOOP_TOKENS), (VOCAB,), generator=gen)]
    tensors[EMBED] = embed
    tensors["lm_head.weight"].index_add_(0, planted, 2 * embed / math.sqrt(HIDDEN))
    return tensors, {"planted_next_token": planted.tolist()}


@_kind("qwen3-random", seed=0)
def build_qwen3_random(p: dict[str, Any]) -> Built:
    """Random Qwen3 target; also stands in for facebook/opt-125m in upstream's ngram test."""
    from transformers import Qwen3ForCausalLM

    config = _qwen3_config()
    tensors, planted = _random_target(_hf_shapes(Qwen3ForCausalLM, config), p["seed"])
    return Built(_config_dict(config), tensors, {**_target_facts(config, "ngram"), **planted})


# Context known-answer targets: greedy next token is x[t-1] + 2 (specgate.knownanswer), read
# through layer 0's attention. Residual stream: the embedding is CONTEXT_EMBED * e(t), one-hot.
# Layer 0 has 16 query heads over 8 KV heads; KV head c carries dims 64c..64c+63 of the
# one-hot as its value and a key that is the same for every token, so a head reads by position
# only (knownanswer's kernel, score margin CONTEXT_SCORE_MARGIN). In each pair of query heads:
# - the previous-token head (centre 1) reads x[t-1] and writes e(x[t-1] + 2) with weight 1;
# - the self head (centre -1: it would read the *next* token) reads x[t] under a causal mask
#   and writes -CONTEXT_EMBED * e(x[t]), cancelling the embedding exactly.
# So the final residual is e(x[t-1] + 2) and the identity lm_head answers x[t-1] + 2 with a
# margin of sqrt(V) = 22.6 logits. Faults move the answer: a future key leaking into the block
# leaves CONTEXT_EMBED * (e(x[t+1]) - e(x[t])), which outweighs the previous-token term (the
# answer becomes x[t+1]); a missing, stale or mispositioned key changes what either head reads.
# Every other layer output (layer 0's MLP) is zero, and there is no other layer (CONTEXT_LAYERS).
CONTEXT_EMBED = 2.0
CONTEXT_SCORE_MARGIN = 30.0
CONTEXT_HEADS, CONTEXT_KV_HEADS = 16, 8


def _context_head_vectors() -> tuple[Any, Any, Any]:
    """Unit key, previous-token query and self query (64 dims each, neox pair layout)."""
    import torch

    half = HEAD_DIM // 2
    key, prev, own = torch.zeros(HEAD_DIM), torch.zeros(HEAD_DIM), torch.zeros(HEAD_DIM)
    for i, w in enumerate(knownanswer.weights()):
        theta = knownanswer.frequency(i)
        key[i] = math.sqrt(w)
        for query, centre in ((prev, 1), (own, -1)):       # phase -centre * theta moves the peak to centre
            query[i] = math.sqrt(w) * math.cos(centre * theta)
            query[i + half] = -math.sqrt(w) * math.sin(centre * theta)
    return key, prev, own


def context_scale() -> float:
    """Norm of the query and key vectors: the score is scale^2 / 8 * g, so the kernel's margin
    becomes CONTEXT_SCORE_MARGIN in the softmax."""
    return math.sqrt(8 * CONTEXT_SCORE_MARGIN / min(knownanswer.margins()))


def _make_context(tensors: dict[str, Any], body: str, qk_norm: bool, hidden: int = HIDDEN,
                  spread: Sequence[float] = ()) -> dict[str, Any]:
    """Set a target's embedding, layer 0 attention and lm_head (_answer_head) as described above and
    zero every other layer output under `body`; returns the facts to record. Tokens live in the
    first V dimensions of a residual of `hidden` >= V dimensions."""
    import torch

    key, prev, own = _context_head_vectors()
    queries = torch.stack([prev, own] * CONTEXT_KV_HEADS)                  # query head 2c + r
    keys = key.repeat(CONTEXT_KV_HEADS, 1)
    scale = context_scale()
    attn = f"{body}layers.0.self_attn."
    columns = math.sqrt(hidden)                      # input_layernorm turns k * e(t) into sqrt(H) e(t)
    if qk_norm:   # Qwen3: q_norm/k_norm rescale each head to RMS `weight`; |u| = 1 has RMS 1/8
        tensors[f"{attn}q_norm.weight"] = torch.full((HEAD_DIM,), scale / 8)
        tensors[f"{attn}k_norm.weight"] = torch.full((HEAD_DIM,), scale / 8)
        queries, keys = queries / columns, keys / columns
    else:         # Qwen2: the projection itself sets the norm (biases zero)
        queries, keys = queries * scale / columns, keys * scale / columns
        for proj in ("q_proj", "k_proj", "v_proj"):
            tensors[f"{attn}{proj}.bias"].zero_()
    tensors[f"{attn}q_proj.weight"] = queries.reshape(-1, 1).expand(-1, hidden).clone()
    tensors[f"{attn}k_proj.weight"] = keys.reshape(-1, 1).expand(-1, hidden).clone()
    tensors[f"{attn}v_proj.weight"] = _token_map(hidden)[:VOCAB] / columns
    o_proj = torch.zeros(hidden, CONTEXT_HEADS * HEAD_DIM)
    for c in range(CONTEXT_KV_HEADS):
        for d in range(HEAD_DIM):
            token = c * HEAD_DIM + d
            o_proj[(token + 2) % VOCAB, (2 * c) * HEAD_DIM + d] = 1.0
            o_proj[token, (2 * c + 1) * HEAD_DIM + d] = -CONTEXT_EMBED
    tensors[f"{attn}o_proj.weight"] = o_proj
    for name in tensors:
        if name.startswith(body) and name.endswith(("o_proj.weight", "down_proj.weight")) \
                and not name.startswith(attn):
            tensors[name] = torch.zeros_like(tensors[name])
    tensors[EMBED] = CONTEXT_EMBED * _token_map(hidden)[:VOCAB]
    tensors["lm_head.weight"] = _answer_head(hidden, spread)
    prev_margin, self_margin = knownanswer.margins()
    facts = {"known_answer": knownanswer.CONTEXT_RULE, "attention_score_margin": CONTEXT_SCORE_MARGIN,
             "kernel_margins": {"previous": prev_margin, "self": self_margin},
             "exact_up_to_positions": knownanswer.MAX_DISTANCE}
    if spread:
        # The logits on a + j, by the dtype the engine computes in. bf16 rounds the head's products
        # back onto the spread (multiples of 0.5 near 24 are bf16 numbers); float32 keeps each
        # bf16-stored weight times the residual's sqrt(H), off the spread by up to 0.04 at H = 512.
        stored = tensors["lm_head.weight"][:len(spread), 0].to(torch.bfloat16).double()
        facts["answer_logits"] = {"bfloat16": list(spread),
                                  "float32": [round(float(w) * math.sqrt(hidden), 6) for w in stored]}
    return facts


def _answer_head(hidden: int, spread: Sequence[float], shift: int = 0) -> Any:
    """The lm_head over a final residual sqrt(H) e(t): logit sqrt(H) = 22.6 on t + shift and 0
    elsewhere, or with `spread` logit spread[j] on t + shift + j, so sampling at temperature T
    draws t + shift + j with probability softmax(spread / T)[j] at every position (the other
    tokens stay at 0, e^-22 below and less). A target's residual stands for its answer (shift 0)."""
    if not spread:
        return _token_map(hidden, shift)[:VOCAB]
    return sum(logit / math.sqrt(hidden) * _token_map(hidden, shift + j)[:VOCAB] for j, logit in enumerate(spread))


# The design reads through layer 0 and zeroes every MLP output, so a second layer would add only
# zeros to the residual, and the MLP's width buys nothing but compute: both cost every verified
# token (a sampling phase verifies over 12k request tokens per engine) and a second layer every
# engine start its tracing. A 64-wide MLP still computes on real numbers (a NaN there still
# reaches the logits) at a sixteenth of the default's cost.
CONTEXT_LAYERS = 1
CONTEXT_MLP = 64
_CONTEXT = dict(num_hidden_layers=CONTEXT_LAYERS, num_attention_heads=CONTEXT_HEADS,
                num_key_value_heads=CONTEXT_KV_HEADS, intermediate_size=CONTEXT_MLP,
                rope_parameters={"rope_type": "default", "rope_theta": knownanswer.ROPE_THETA})


@_kind("qwen3-context", seed=0, spread=[])
def build_qwen3_context(p: dict[str, Any]) -> Built:
    """Known-answer Qwen3 target whose answer depends on the previous token (x[t-1] + 2);
    with `spread`, sampling draws x[t-1] + 2 + j with known probabilities (_answer_head)."""
    from transformers import Qwen3ForCausalLM

    config = _qwen3_config(**_CONTEXT)
    tensors = _randomize(_hf_shapes(Qwen3ForCausalLM, config), p["seed"])
    facts = _make_context(tensors, "model.", qk_norm=True, spread=p["spread"])
    return Built(_config_dict(config), tensors, {**_target_facts(config), **facts})


# ---------------------------------------------------------------------------
# EAGLE-3 drafts (yuhuili/EAGLE3 layout, LlamaForCausalLMEagle3, one layer)
# ---------------------------------------------------------------------------

# Target layers whose hidden states feed the draft's fc: 0 is the embedding output, L the last
# layer's. Set explicitly: for a 2-layer target the default (2, L // 2, L - 3) has only 2 states.
# The successor draft pairs with the one-layer context targets: the embedding's and the layer's.
EAGLE3_AUX_LAYERS = [0, 1, TARGET_LAYERS]
EAGLE3_CONTEXT_AUX_LAYERS = [0, CONTEXT_LAYERS]


def _eagle3_config(aux_layers: list[int] = EAGLE3_AUX_LAYERS, **overrides: Any) -> dict[str, Any]:
    from transformers import LlamaConfig

    config = LlamaConfig(**{**_COMMON, "num_hidden_layers": 1,
                            "architectures": ["LlamaForCausalLMEagle3"]})
    return {
        **_config_dict(config),
        "draft_vocab_size": VOCAB,        # no d2t/t2d maps needed
        "target_hidden_size": HIDDEN,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layers,
                         "use_aux_hidden_state": True},
        **overrides,
    }


def _eagle3_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, q = config["hidden_size"], config["num_attention_heads"] * HEAD_DIM
    kv, inter = config["num_key_value_heads"] * HEAD_DIM, config["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),        # input: [embeds, hidden]
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "fc.weight": (h, HIDDEN * len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])),
        "lm_head.weight": (VOCAB, h),
    }
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        shapes[f"midlayer.{norm}.weight"] = (h,)
    shapes["norm.weight"] = (h,)
    return shapes


@_kind("eagle3-random", seed=0)
def build_eagle3_random(p: dict[str, Any]) -> Built:
    """Random EAGLE-3 draft; embed_tokens is absent, so vLLM shares the target's."""
    config = _eagle3_config()
    tensors = _randomize(_eagle3_shapes(config), p["seed"])
    return Built(config, tensors, _draft_facts(config, "eagle3", EAGLE3_AUX_LAYERS, successor=False))


@_kind("eagle3-successor", seed=0, spread=[], head_shift=1)
def build_eagle3_successor(p: dict[str, Any]) -> Built:
    """Known-answer EAGLE-3 draft proposing successor chains: every draft step moves one token on.

    At position i the draft gets the target's hidden states for token t_i and proposes t_i + 2
    (right for the context target: x[i+2] = x[i] + 2); its own output hidden state becomes the
    next step's input and stands for t_i + 1, so step s proposes t_i + s + 1 (right only where
    the target's answer is a successor chain: elsewhere step 2 is wrong).
    - fc picks the aux state of layer 0, the embedding (a multiple of e(t_i)); with
      norm_before_residual the residual is hidden_norm(h) = sqrt(V) e(t).
    - Attention is off (o_proj = 0), so the MLP sees sqrt(V) e(t) only. It is a lookup table:
      gate = 4 I and up = I give 4 sqrt(V) * sqrt(V) = 2048 on neuron t (silu(90.5) = 90.5), and
      down = e(t + 1) / 64 - e(t) / (4 sqrt(V)) writes 32 e(t + 1) and cancels the residual.
    - The lm_head is the successor map, so logits peak at t + 2 and the fed-back hidden state
      32 e(t + 1) normalises to sqrt(V) e(t + 1) for the next step.
    - `head_shift` 2 moves every draft one token on (t + 3: the first draft one past the answer).
      With `spread` the head gives t + 1 + head_shift + j logit spread[j] (_answer_head), so
      probabilistic drafts come from a spread q: acceptance is min(1, p / q), not p, and recovery's
      max(0, p - q) is not the one-hot residual (the greedy drafts' mask).
    """
    import torch

    config = _eagle3_config(EAGLE3_CONTEXT_AUX_LAYERS, norm_before_residual=True, intermediate_size=VOCAB)
    tensors = _randomize(_eagle3_shapes(config), p["seed"])
    eye = torch.eye(VOCAB)
    tensors["midlayer.self_attn.o_proj.weight"].zero_()
    unused_aux = torch.zeros(VOCAB, HIDDEN * (len(EAGLE3_CONTEXT_AUX_LAYERS) - 1))
    tensors["fc.weight"] = torch.cat([eye, unused_aux], dim=1)
    tensors["midlayer.mlp.gate_proj.weight"] = 4 * eye
    tensors["midlayer.mlp.up_proj.weight"] = eye.clone()
    tensors["midlayer.mlp.down_proj.weight"] = _token_map(HIDDEN, 1) / 64 - eye / (4 * math.sqrt(VOCAB))
    tensors["lm_head.weight"] = _answer_head(HIDDEN, p["spread"], shift=p["head_shift"])
    return Built(config, tensors, _draft_facts(config, "eagle3", EAGLE3_CONTEXT_AUX_LAYERS, successor=True,
                                               target_layers=CONTEXT_LAYERS))


# ---------------------------------------------------------------------------
# MiMo targets with one MTP layer in the same checkpoint (method "mtp", no draft model)
# ---------------------------------------------------------------------------

def _mimo_config(**overrides: Any) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**{**_COMMON, "num_hidden_layers": TARGET_LAYERS,
                          "architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1, **overrides})


def _mimo_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """transformers' Qwen2 names for the body; the MTP layer reuses a body layer's names."""
    from transformers import Qwen2ForCausalLM

    shapes = _hf_shapes(Qwen2ForCausalLM, config)
    h = config.hidden_size
    mtp = "model.mtp_layers.0."
    for name, shape in list(shapes.items()):
        if name.startswith("model.layers.0."):
            shapes[mtp + name.removeprefix("model.layers.0.")] = shape
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        shapes[f"{mtp}{norm}.weight"] = (h,)
    shapes[f"{mtp}input_proj.weight"] = (h, 2 * h)               # input: [hidden, embeds]
    return shapes


@_kind("mimo-mtp-random", seed=0)
def build_mimo_mtp_random(p: dict[str, Any]) -> Built:
    config = _mimo_config()
    tensors, planted = _random_target(_mimo_shapes(config), p["seed"])
    return Built(_config_dict(config), tensors, {**_target_facts(config, "mtp"), **planted})


# vLLM's Qwen2 attention takes head_dim = hidden_size / heads, so MiMo's 16 heads of 64 need a
# 1024-wide residual (tokens in its first V dimensions).
MIMO_CONTEXT_HIDDEN = CONTEXT_HEADS * HEAD_DIM


@_kind("mimo-mtp-context", seed=0, spread=[])
def build_mimo_mtp_context(p: dict[str, Any]) -> Built:
    """Known-answer MiMo target: the body is a context target (x[t-1] + 2, see _make_context) and
    the MTP layer proposes successor chains.

    At position i the MTP layer gets embed(t_{i+1}) and the target's hidden state at i, which
    is e(x[i-1] + 2) = e(t_{i+1}); it proposes t_{i+1} + 1. input_proj = [S, S / 2] over
    [hidden, embeds] (S the successor shift) writes e(t_{i+1} + 1) from both halves, the hidden
    half dominating (so a wrong hidden state shows in the draft; at position 0 MiMo zeroes the
    embedding anyway). The MTP block's outputs are zero and the lm_head is the identity.
    """
    import torch

    config = _mimo_config(**_CONTEXT, hidden_size=MIMO_CONTEXT_HIDDEN)
    tensors = _randomize(_mimo_shapes(config), p["seed"])
    facts = _make_context(tensors, "model.", qk_norm=False, hidden=MIMO_CONTEXT_HIDDEN, spread=p["spread"])
    shift = _token_map(MIMO_CONTEXT_HIDDEN, 1)
    tensors["model.mtp_layers.0.input_proj.weight"] = torch.cat([shift, shift / 2], 1)
    return Built(_config_dict(config), tensors, {**_target_facts(config, "mtp"), **facts})


# ---------------------------------------------------------------------------
# DFlash drafts (z-lab DFlashDraftModel layout): one parallel pass drafts k tokens
# ---------------------------------------------------------------------------

DFLASH_TARGET_LAYERS = [0, TARGET_LAYERS - 1]       # vLLM adds 1: aux states after layers 1, 2
DFLASH_CONTEXT_TARGET_LAYERS = [CONTEXT_LAYERS - 1]  # the successor's: after the context target's layer


def _dflash_config(target_layer_ids: list[int] = DFLASH_TARGET_LAYERS, **overrides: Any) -> dict[str, Any]:
    config = _qwen3_config(num_hidden_layers=1, architectures=["DFlashDraftModel"], **overrides)
    return {
        **_config_dict(config),
        "target_hidden_size": HIDDEN,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": target_layer_ids},
    }


def _dflash_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, q = config["hidden_size"], config["num_attention_heads"] * HEAD_DIM
    kv, inter = config["num_key_value_heads"] * HEAD_DIM, config["intermediate_size"]
    layer = "layers.0."
    shapes = {
        f"{layer}self_attn.q_proj.weight": (q, h),
        f"{layer}self_attn.k_proj.weight": (kv, h),
        f"{layer}self_attn.v_proj.weight": (kv, h),
        f"{layer}self_attn.o_proj.weight": (h, q),
        f"{layer}self_attn.q_norm.weight": (HEAD_DIM,),
        f"{layer}self_attn.k_norm.weight": (HEAD_DIM,),
        f"{layer}mlp.gate_proj.weight": (inter, h),
        f"{layer}mlp.up_proj.weight": (inter, h),
        f"{layer}mlp.down_proj.weight": (h, inter),
        "fc.weight": (h, HIDDEN * len(config["dflash_config"]["target_layer_ids"])),
    }
    for norm in (f"{layer}input_layernorm", f"{layer}post_attention_layernorm", "hidden_norm", "norm"):
        shapes[f"{norm}.weight"] = (h,)
    return shapes


def _dflash_facts(config: dict[str, Any], successor: bool, **extra: Any) -> dict[str, Any]:
    layers = config["dflash_config"]["target_layer_ids"]
    return _draft_facts(config, "dflash", [i + 1 for i in layers], successor,
                        CONTEXT_LAYERS if successor else TARGET_LAYERS, mask_token_id=MASK_ID,
                        target_layer_ids=layers, **extra)


@_kind("dflash-random", seed=0)
def build_dflash_random(p: dict[str, Any]) -> Built:
    """Random DFlash draft; embed_tokens and lm_head are shared from the target."""
    config = _dflash_config()
    tensors = _randomize(_dflash_shapes(config), p["seed"])
    return Built(config, tensors, _dflash_facts(config, successor=False))


# Positional attention kernel of the DFlash successor draft, on RoPE pairs (i, i + 32) with
# frequency 10000 ** (-i / 32): f(d) = 0.8 cos(d) + 0.2 cos(0.5623 d) - c peaks at d = 0, and the
# nearly-constant pair 31 supplies -c, placed halfway between f's peak and its next-highest value.
DFLASH_KERNEL = {0: 0.8, 2: 0.2}
DFLASH_CONST_PAIR = 31
DFLASH_LOGIT_MARGIN = 64.0


def _rope_freq(pair: int) -> float:
    return 10000.0 ** (-pair / (HEAD_DIM // 2))


def dflash_kernel(k_max: int) -> tuple[float, float]:
    """(c, margin) of the kernel over the offsets |d| <= 2 k_max - 1 that k_max heads can see."""
    off_peak = max(sum(a * math.cos(d * _rope_freq(i)) for i, a in DFLASH_KERNEL.items())
                   for d in range(1, 2 * k_max))
    return (1 + off_peak) / 2, (1 - off_peak) / 2


@_kind("dflash-successor", seed=0, max_speculative_tokens=5)
def build_dflash_successor(p: dict[str, Any]) -> Built:
    """Known-answer DFlash draft proposing successor chains: mask slot j proposes x + j, where x
    is the bonus token of its query block, for every j <= max_speculative_tokens (K). Paired with
    a context target, whose embedding (CONTEXT_EMBED * I) and identity lm_head it shares.

    A query block is [x, mask, ..., mask] at positions p..p+k, attending (non-causally) to each
    other and to context K/V at positions < p. Each slot must find x and know its own offset j,
    so the draft attends by position only:
    - fc = 0, so the context's keys and values are zero: a context key scores exactly 0.
    - 8 K query heads over 8 KV heads of 64 dims. KV head c carries dims 64c..64c+63 of the
      slot's one-hot embedding as its value (v_proj = I / sqrt(V)), and a key that is the same
      for every token (all k_proj columns equal). Query head (c, h), h = 1..K, is also
      content-free, with RoPE phases that put the kernel's peak at relative offset h: its score
      is +margin for the key exactly h positions back and <= -margin for every other key in the
      block, so it reads the token h back when that is in the block, else the zero context.
    - Slot j thus gets from head h: the mask token (h < j), x (h = j), nothing (h > j). o_proj
      writes head h's token t to residual dim t + h with weight w_h = 1024 * 256^(h - 1). Dim
      x + j gets w_j and every other dim at most max(CONTEXT_EMBED, w_(j-1)) (the slot's own
      embedding, the masks' dims), so after the final norm the identity lm_head peaks at x + j.
      The MLP output is zero.
    - The spread target's lm_head also scores a + 1 at 23.5 / 24 of a for every residual dim a,
      so a dim next to x + j must stay under 1/48 of it: w_j / w_(j-1) = 256 and w_1 / CONTEXT_EMBED
      = 512 keep the draft exact there too (margin >= 0.43 of the design's 0.5), and the 64-logit
      attention margin keeps what a head with nothing to read leaks (e^-64 of a value) below that.
    """
    import torch

    k_max = p["max_speculative_tokens"]
    if not 1 <= k_max <= 8:
        raise FixtureError(f"dflash-successor: max_speculative_tokens must be 1..8, got {k_max}")
    heads = 8 * k_max
    config = _dflash_config(DFLASH_CONTEXT_TARGET_LAYERS, num_attention_heads=heads, num_key_value_heads=8,
                            intermediate_size=64)
    tensors = _randomize(_dflash_shapes(config), p["seed"])
    const, margin = dflash_kernel(k_max)
    # Pre-RoPE key and query vectors: amplitude sqrt(a) on pair i, query phase -h * theta_i.
    half = HEAD_DIM // 2
    amps = {**DFLASH_KERNEL, DFLASH_CONST_PAIR: const}
    key = torch.zeros(HEAD_DIM)
    query = torch.zeros(k_max, HEAD_DIM)
    for i, a in amps.items():
        sign = -1.0 if i == DFLASH_CONST_PAIR else 1.0
        key[i] = math.sqrt(a)
        for h in range(1, k_max + 1):
            query[h - 1, i] = sign * math.sqrt(a) * math.cos(h * _rope_freq(i))
            query[h - 1, i + half] = -sign * math.sqrt(a) * math.sin(h * _rope_freq(i))
    # q_norm/k_norm rescale both to RMS s; the score is (1/8) * 64 s^2 / (1 + c) * f(d).
    scale = math.sqrt(DFLASH_LOGIT_MARGIN * (1 + const) / (8 * margin))
    layer = "layers.0."
    norm_input = math.sqrt(VOCAB)                    # input_layernorm turns e(t) into sqrt(V) e(t)
    # Every column equal: the same pre-norm query (key) for every one-hot input.
    tensors[f"{layer}self_attn.q_proj.weight"] = query.repeat(8, 1).reshape(-1, 1).expand(-1, VOCAB) / norm_input
    tensors[f"{layer}self_attn.k_proj.weight"] = key.repeat(8).reshape(-1, 1).expand(-1, VOCAB) / norm_input
    tensors[f"{layer}self_attn.v_proj.weight"] = torch.eye(VOCAB) / norm_input
    tensors[f"{layer}self_attn.q_norm.weight"] = torch.full((HEAD_DIM,), scale)
    tensors[f"{layer}self_attn.k_norm.weight"] = torch.full((HEAD_DIM,), scale)
    o_proj = torch.zeros(VOCAB, heads * HEAD_DIM)
    for c in range(8):
        for h in range(1, k_max + 1):
            column = (c * k_max + h - 1) * HEAD_DIM
            for d in range(HEAD_DIM):
                o_proj[(c * HEAD_DIM + d + h) % VOCAB, column + d] = 1024.0 * 256.0 ** (h - 1)
    tensors[f"{layer}self_attn.o_proj.weight"] = o_proj
    tensors[f"{layer}mlp.down_proj.weight"].zero_()
    tensors["fc.weight"].zero_()
    return Built(config, tensors, _dflash_facts(config, successor=True, max_speculative_tokens=k_max,
                                                attention_logit_margin=DFLASH_LOGIT_MARGIN))


# ---------------------------------------------------------------------------
# Qwen3.5 hybrid (Gated DeltaNet + full attention) with one MTP layer
# ---------------------------------------------------------------------------

@_kind("qwen35-mtp-random", seed=0)
def build_qwen35_mtp_random(p: dict[str, Any]) -> Built:
    """Random Qwen3_5ForCausalLM (model type qwen3_5_text): one GDN layer, one full-attention
    layer, and an MTP layer (mtp.*) that is a full-attention decoder layer. Its RMSNorms are
    the (1 + w) kind, so their weights are 0."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**{
        **_COMMON, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "num_key_value_heads": 2, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
        "mtp_num_hidden_layers": 1, "architectures": ["Qwen3_5ForCausalLM"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    })
    shapes = _hf_shapes(Qwen3_5ForCausalLM, config)
    full = f"model.layers.{config.layer_types.index('full_attention')}."
    for name, shape in list(shapes.items()):
        if name.startswith(full):
            shapes["mtp.layers.0." + name.removeprefix(full)] = shape
    h = config.hidden_size
    shapes["mtp.fc.weight"] = (h, 2 * h)                          # input: [embeds, hidden]
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        shapes[f"mtp.{norm}.weight"] = (h,)
    tensors, planted = _random_target(shapes, p["seed"], norm_value=0.0)
    facts = {**_target_facts(config, "mtp"), **planted}
    facts["layer_types"] = list(config.layer_types)
    facts["needs"] = "torchvision (vLLM's qwen3_5 module imports it through qwen3_vl)"
    return Built(_config_dict(config), tensors, facts)


# ---------------------------------------------------------------------------
# Hash, build, cache
# ---------------------------------------------------------------------------

def resolve_params(fixture: Fixture) -> dict[str, Any]:
    """The kind's default params overridden by the manifest's; unknown kinds or keys fail."""
    if fixture.kind not in FIXTURE_KINDS:
        raise FixtureError(f"fixture {fixture.name!r}: unknown kind {fixture.kind!r} "
                           f"(known: {', '.join(sorted(FIXTURE_KINDS))})")
    defaults = _DEFAULT_PARAMS[fixture.kind]
    unknown = sorted(set(fixture.params) - set(defaults))
    if unknown:
        raise FixtureError(f"fixture {fixture.name!r}: unknown param(s) {', '.join(unknown)} for kind "
                           f"{fixture.kind!r} (known: {', '.join(sorted(defaults)) or 'none'})")
    for key, value in fixture.params.items():
        if type(value) is not type(defaults[key]):
            raise FixtureError(f"fixture {fixture.name!r}: param {key!r} must be "
                               f"{type(defaults[key]).__name__}, got {value!r}")
    return {**defaults, **fixture.params}


def fixture_hash(fixture: Fixture) -> str:
    """sha256 over everything that decides the bytes: the builders' sources, the kind, the
    resolved params and the versions of the libraries that write the files."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES))
    versions = {lib: metadata.version(lib) for lib in BYTES_LIBRARIES}
    payload = {"kind": fixture.kind, "params": resolve_params(fixture), "versions": versions}
    digest.update(json.dumps(payload, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def _fixture(manifest: Manifest, name: str) -> Fixture:
    try:
        return manifest.fixtures[name]
    except KeyError:
        known = ", ".join(sorted(manifest.fixtures))
        raise FixtureError(f"unknown fixture {name!r} (known: {known})") from None


DIGESTS = "specgate-digests.json"   # written last into a built fixture: its files' sizes and sha256


def fixture_dir(manifest: Manifest, name: str) -> Path:
    """Where the fixture lives once built (it may not exist yet)."""
    return cache_root() / "fixtures" / f"{name}-{fixture_hash(_fixture(manifest, name))}"


def file_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file of a fixture folder but the digests file itself."""
    return {path.name: {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
            for path in sorted(folder.iterdir()) if path.is_file() and path.name != DIGESTS}


def damage(folder: Path, *, full: bool) -> str | None:
    """What is wrong with a built fixture folder (None: it is whole). Sizes always; sha256 too
    when `full` (warm_cache): a job killed mid-write or a full disk leaves a short file, a bad
    disk a changed one. A folder without its digests predates them and cannot be trusted."""
    try:
        recorded = json.loads((folder / DIGESTS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"{DIGESTS} missing or unreadable"
    for name, want in recorded.items():
        path = folder / name
        if not path.is_file():
            return f"{name} missing"
        if path.stat().st_size != want["size"]:
            return f"{name} has {path.stat().st_size} bytes, {want['size']} when built"
        if full and hashlib.sha256(path.read_bytes()).hexdigest() != want["sha256"]:
            return f"{name} does not match the sha256 it had when built"
    return None


def _write(built: Built, dest: Path, record: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    dest.mkdir(parents=True)
    tensors = _bf16(built.tensors)
    save_file({k: tensors[k] for k in sorted(tensors)}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    files = {"config.json": json.dumps(built.config, indent=2, sort_keys=True) + "\n",
             "fixture.json": json.dumps({**record, **built.facts}, indent=2, sort_keys=True) + "\n",
             **_tokenizer_files()}
    for filename, text in files.items():
        (dest / filename).write_text(text, encoding="utf-8")
    (dest / DIGESTS).write_text(json.dumps(file_digests(dest), indent=2) + "\n", encoding="utf-8")   # last: complete


def build(fixture: Fixture, dest: Path) -> None:
    """Build one fixture into dest (which must not exist); no cache, no lock."""
    params = resolve_params(fixture)
    built = FIXTURE_KINDS[fixture.kind](params)
    record = {"kind": fixture.kind, "params": params, "hash": fixture_hash(fixture)}
    _write(built, dest, record)


def ensure(manifest: Manifest, name: str, *, full: bool = False) -> Path:
    """The fixture's checkpoint folder, built if missing and rebuilt if damaged (sizes checked
    on every use, sha256 too when `full`), so a broken cache is repaired, never a test failure.
    Concurrent callers (threads or processes) wait on one file lock, so exactly one builds; the
    build goes to a temporary folder that is renamed into place, so a killed build never leaves
    half a fixture, and a damaged one is moved aside whole (a reader keeps its open files)."""
    from filelock import FileLock

    path = fixture_dir(manifest, name)
    if path.is_dir() and damage(path, full=full) is None:
        return path
    with FileLock(str(path.parent / f".{path.name}.lock")):
        found = damage(path, full=full) if path.is_dir() else None
        if path.is_dir() and found is None:
            return path
        for stale in path.parent.glob(f".{path.name}.tmp*"):
            shutil.rmtree(stale, ignore_errors=True)      # left by a killed build or repair; we hold the lock
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp"))
        try:
            if found is not None:
                print(f"fixture {name}: {found}; rebuilding it", file=sys.stderr, flush=True)
                os.replace(path, tmp / "damaged")
            build(manifest.fixtures[name], tmp / "out")
            os.replace(tmp / "out", path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_all(manifest: Manifest, names: Sequence[str] | None = None, *, full: bool = False) -> dict[str, Path]:
    chosen = list(manifest.fixtures) if names is None else list(names)
    return {name: ensure(manifest, name, full=full) for name in chosen}


def describe(manifest: Manifest, name: str) -> dict[str, Any]:
    """name, kind, hash, path and the facts tests need (vocab_size, aux_layer_ids, mask_token_id,
    known_answer: the specgate.knownanswer rule a target's greedy continuation follows, ...)."""
    path = ensure(manifest, name)
    facts = json.loads((path / "fixture.json").read_text(encoding="utf-8"))
    return {"name": name, **facts, "path": path}


# ---------------------------------------------------------------------------
# CLI: python -m specgate.fixtures [--only NAME ...] [--print-paths]
# ---------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specgate.fixtures",
                                     description="Build the fixture checkpoints the manifest declares.")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="build only these fixtures")
    parser.add_argument("--print-paths", action="store_true", help="print NAME<TAB>PATH per fixture")
    parser.add_argument("--manifest", default=None, help="manifest path (default: the repo's)")
    args = parser.parse_args(argv)
    try:
        manifest = load(args.manifest) if args.manifest else load()
        names = args.only or list(manifest.fixtures)
        for name in names:
            fixture_hash(_fixture(manifest, name))      # validate every name before building any
        paths = ensure_all(manifest, names)
    except ManifestError as exc:
        print(f"specgate.fixtures: {exc}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}\t{path}" if args.print_paths else f"fixture {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
