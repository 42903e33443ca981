"""Every transformers architecture that builds tiny: fastckpt's folder and its serving export against
``save_pretrained`` (the reference writer's own output is the specification).

For each class of transformers' causal-LM, seq2seq, masked-LM and sequence-classification mappings,
built from its config's defaults shrunk to a few thousand parameters (:func:`_tiny`; classes that do
not build so, need more than 200 MB or that ``save_pretrained`` itself cannot save are skipped and
counted), the test

1. saves it fastckpt's way (``model_snapshot`` + ``fastckpt.save``) and then with ``save_pretrained``;
2. diffs the two folders (:func:`refdiff.diff_folders`): equal, except for the classes transformers
   converts on load (fused MoE experts, fused projections), whose checkpoint keeps the in-memory layout;
3. exports both with ``fastckpt load SRC --to OUT`` (exit 0: the servability gate accepts what
   transformers wrote, and fastckpt's own checkpoint) and reloads each export with the class's
   ``from_pretrained``: every tensor equal to the model's, the tensor names those of ``save_pretrained``.

A 407-class probe of this kind (2026-12-06) found XLM-R's tied weights saved under the wrong name,
Marian's ignored position tables, and MoE / NomicBert checkpoints the export refused. Runs against the
transformers version CI pins (about 2 minutes); ``scripts/test_newest.sh`` does not run it.
"""

from __future__ import annotations

import contextlib
import io
import signal
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastckpt  # noqa: E402
from fastckpt.cli.main import main  # noqa: E402
from fastckpt.format.layout import REFERENCE_ADDITIONS  # noqa: E402
from fastckpt.integrations.hf.snapshot import model_snapshot  # noqa: E402
from fastckpt.loading.servable import converted_on_save, saved_names  # noqa: E402
from refdiff import diff_folders  # noqa: E402

MAPPINGS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
            "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES")
#: Size fields set where a config has them (ints only), so that every model has a few thousand parameters.
SIZES = dict(hidden_size=16, d_model=16, n_embd=16, dim=16, embed_dim=16, n_embed=16, d_embed=16,
             num_hidden_layers=1, num_layers=1, n_layer=1, n_layers=1, num_decoder_layers=1, encoder_layers=1,
             decoder_layers=1, num_encoder_layers=1, num_attention_heads=2, n_head=2, n_heads=2,
             encoder_attention_heads=2, decoder_attention_heads=2, num_heads=2, num_key_value_heads=1,
             n_kv_heads=1, intermediate_size=32, d_ff=32, ffn_dim=32, encoder_ffn_dim=32, decoder_ffn_dim=32,
             n_inner=32, hidden_dim=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
             vocab_size=96, max_position_embeddings=64, n_positions=64, head_dim=8, d_kv=8, num_experts=2,
             num_local_experts=2, n_routed_experts=2, num_experts_per_tok=1, kv_lora_rank=8, q_lora_rank=8,
             qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
             "cls_token_id", "mask_token_id", "image_token_id", "image_token_index", "audio_token_id",
             "boi_token_id", "eoi_token_id", "video_token_id")
#: Fewer checked classes than this means the sweep itself broke (transformers 5.24.0: 341).
MIN_CHECKED = 250


class _Timeout(Exception):
    pass


def _shrink(cfg, depth: int = 0) -> None:
    for k, v in SIZES.items():
        if isinstance(getattr(cfg, k, None), int) and not isinstance(getattr(cfg, k), bool):
            with contextlib.suppress(Exception):
                setattr(cfg, k, v)
    layers = next((getattr(cfg, k) for k in ("num_hidden_layers", "num_layers", "n_layer")
                   if isinstance(getattr(cfg, k, None), int)), None)
    for k, v in list(vars(cfg).items()):  # per-layer lists follow the layer count
        if layers and isinstance(v, list) and len(v) > 1 and k.endswith(
                ("layer_types", "_layers", "per_layer", "layers_block_type", "block_types")):
            with contextlib.suppress(Exception):
                setattr(cfg, k, v[:layers])
    vocab = getattr(cfg, "vocab_size", None)
    if isinstance(vocab, int):  # special token ids inside the shrunk vocabulary
        for k in TOKEN_IDS:
            v = getattr(cfg, k, None)
            with contextlib.suppress(Exception):
                if isinstance(v, int) and v >= vocab:
                    setattr(cfg, k, min(vocab - 1, 2 + len(k) % 5))
                elif isinstance(v, list):
                    setattr(cfg, k, [min(x, vocab - 1) for x in v])
    if depth < 2:
        for v in list(vars(cfg).values()):
            if isinstance(v, transformers.PretrainedConfig):
                _shrink(v, depth + 1)


def _tiny(cls, model_type: str):
    """``cls`` built from ``model_type``'s default config shrunk (fp32, CPU, eval), or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        cfg = CONFIG_MAPPING[model_type]()
        _shrink(cfg)
        with contextlib.suppress(Exception):
            cfg = type(cfg).from_dict(cfg.to_dict())  # the config's own checks, on the shrunk values
        torch.manual_seed(0)
        model = cls(cfg).float().eval()
    except Exception:  # noqa: BLE001 - a class these generic sizes cannot build: not checked
        return None
    return model if sum(p.numel() for p in model.parameters()) * 4 <= 200e6 else None


def _classes() -> list[tuple[str, str]]:
    import transformers.models.auto.modeling_auto as auto

    out = {}
    for mapping in MAPPINGS:
        for model_type, arch in getattr(auto, mapping).items():
            for a in arch if isinstance(arch, (list, tuple)) else (arch,):
                if isinstance(getattr(transformers, a, None), type):
                    out.setdefault((mapping, a), model_type)
    return [(a, mt) for (_, a), mt in sorted(out.items())]


def _names(folder) -> set[str]:
    from safetensors import safe_open

    out = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out |= set(h.keys())
    return out


def _check(cls, model, d) -> list[str] | None:
    """The problems of one class (empty: fastckpt agrees with save_pretrained; None: transformers
    cannot save it, or read back what it saved, either)."""
    orig = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        state, weights, extra = model_snapshot(model)
        fastckpt.save(state, d / "ck", weights=weights, extra_files=extra)
        ours = None
    except Exception as e:  # noqa: BLE001 - a fault only if save_pretrained saves it
        ours = e
    try:
        model.save_pretrained(d / "ref")
    except Exception:  # noqa: BLE001 - transformers cannot save it either (its config's own checks): skipped
        return None
    try:
        cls.from_pretrained(d / "ref")
    except Exception:  # noqa: BLE001 - transformers cannot read its own folder (a config the shrinking broke)
        return None
    if ours is not None:
        return [f"fastckpt cannot save what save_pretrained saves: {type(ours).__name__}: {ours}"]
    problems = []
    converted = converted_on_save(d / "ref", [*_names(d / "ck"), *saved_names(d / "ref")])
    diffs = diff_folders(d / "ref", d / "ck", REFERENCE_ADDITIONS)
    if diffs and not converted and not saved_names(d / "ref"):
        problems.append(f"folder differs from save_pretrained: {diffs[:2]}")
    for src in ("ref", "ck"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = main(["load", str(d / src), "--to", str(d / f"{src}-out"), "-q"])
        if rc != 0:
            problems.append(f"fastckpt load {src} --to: exit {rc}: {err.getvalue()[-300:]}")
            continue
        if _names(d / f"{src}-out") != _names(d / "ref"):
            problems.append(f"{src}-out tensor names differ from save_pretrained's: "
                            f"{sorted(_names(d / f'{src}-out') ^ _names(d / 'ref'))[:4]}")
        back = cls.from_pretrained(d / f"{src}-out").float().state_dict()
        bad = [k for k, v in orig.items() if k not in back or not torch.equal(back[k], v)]
        if bad:
            problems.append(f"{src}-out reloads other values: {bad[:4]}")
    return problems


def test_every_architecture_folder_and_export_agree_with_save_pretrained(tmp_path):
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    def _alarm(*_):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, _alarm)
    failures, checked, skipped = {}, 0, 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, (arch, model_type) in enumerate(_classes()):
                signal.alarm(60)
                try:
                    cls = getattr(transformers, arch)
                    model = _tiny(cls, model_type)
                    if model is None:
                        skipped += 1
                        continue
                    problems = _check(cls, model, tmp_path / f"{i}-{arch}")
                    if problems is None:
                        skipped += 1
                        continue
                    checked += 1
                    if problems:
                        failures[arch] = problems
                except _Timeout:
                    skipped += 1
                finally:
                    signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert not failures, f"{len(failures)} of {checked} classes:\n" + "\n".join(
        f"{a}: {'; '.join(p)}" for a, p in sorted(failures.items()))
    assert checked >= MIN_CHECKED, f"only {checked} classes built and checked ({skipped} skipped): the sweep broke"
