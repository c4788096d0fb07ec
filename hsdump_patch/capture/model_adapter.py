"""What the patch relies on in SGLang's model code: locating the decoder stack, resolving the
EAGLE-3 layers exactly as SGLang does, and checking that the capture points still exist.

The capture point is the one SGLang's own EAGLE-3 path uses: each decoder layer's attention
boundary (``layer.attn_boundary.prepare``) hands a ``capture_gathered`` collector the updated
residual, i.e. the full residual stream at the layer's input, after any deferred all-reduce
has been completed by the normal (possibly fused) kernel path.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)
# The SGLang functions the plugin registers its hooks on (capture/plugin.py).
HOOK_TARGETS = (
    "sglang.srt.server_args.ServerArgs.resolve_once",
    "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs",
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
)

# (module, causal-LM classes, decoder-layer class) the patch is written and tested against.
SUPPORTED_MODELS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("sglang.srt.models.deepseek_v2", ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
     "DeepseekV2DecoderLayer"),
    ("sglang.srt.models.kimi_k25", ("KimiK25ForConditionalGeneration",), ""),
    ("sglang.srt.models.llama", ("LlamaForCausalLM",), "LlamaDecoderLayer"),
    ("sglang.srt.models.qwen2", ("Qwen2ForCausalLM",), "Qwen2DecoderLayer"),
    ("sglang.srt.models.qwen3", ("Qwen3ForCausalLM",), "Qwen3DecoderLayer"),
    ("sglang.srt.models.qwen3_moe", ("Qwen3MoeForCausalLM",), "Qwen3MoeDecoderLayer"),
)
# Attributes SGLang's set_eagle3_layers_to_capture writes; snapshotted and restored around it.
_EAGLE3_STATE_ATTRS = ("layers_to_capture", "capture_aux_hidden_states", "_is_layer_to_capture")
_FORWARD_BATCH_FIELDS = ("forward_mode", "rids", "extend_seq_lens_cpu", "extend_prefix_lens_cpu",
                         "input_ids", "positions")


class UnsupportedModel(RuntimeError):
    """The served model does not expose the capture points the patch needs."""


@dataclass(frozen=True)
class DecoderStack:
    """The decoder stack of a served model: where the capture hooks go."""

    causal_lm: nn.Module
    inner: nn.Module  # the module holding ``layers``; its forward receives the ForwardBatch
    layers: nn.ModuleList
    num_layers: int
    hidden_size: int
    architecture: str


def locate_decoder_stack(causal_lm: nn.Module) -> DecoderStack:
    """Find the decoder stack (``model.model``, or ``language_model.model`` for Kimi-K2.5)."""
    candidates = []
    for name, module in causal_lm.named_modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and any(
            hasattr(layer, "attn_boundary") for layer in layers
        ):
            candidates.append((name.count("."), name, module))
    if not candidates:
        raise UnsupportedModel(
            f"hsdump: {type(causal_lm).__name__} has no decoder stack with attention "
            "boundaries (layers[i].attn_boundary): this model does not use SGLang's stage "
            "boundary framework, so its EAGLE-3 capture point is unavailable. Supported: "
            + ", ".join(c for _, classes, _ in SUPPORTED_MODELS for c in classes)
        )
    _, _, inner = min(candidates, key=lambda c: c[:2])
    config = getattr(inner, "config", None) or getattr(causal_lm, "config", None)
    text_config = getattr(config, "text_config", None) or config
    return DecoderStack(
        causal_lm=causal_lm,
        inner=inner,
        layers=inner.layers,
        num_layers=int(text_config.num_hidden_layers),
        hidden_size=int(text_config.hidden_size),
        architecture=type(causal_lm).__name__,
    )


@contextmanager
def _restored_eagle3_state(root: nn.Module) -> Iterator[None]:
    saved = [
        (module, attr, module.__dict__[attr])
        for module in root.modules()
        for attr in _EAGLE3_STATE_ATTRS
        if attr in module.__dict__
    ]
    present = {(id(m), a) for m, a, _ in saved}
    try:
        yield
    finally:
        for module in root.modules():
            for attr in _EAGLE3_STATE_ATTRS:
                if attr in module.__dict__ and (id(module), attr) not in present:
                    delattr(module, attr)
        for module, attr, value in saved:
            setattr(module, attr, value)


def eagle3_serving_layers(stack: DecoderStack, draft_layer_ids: list[int] | None) -> list[int]:
    """Return the capture indices SGLang's EAGLE-3 serving path would feed a drafter.

    Asks the model's own ``set_eagle3_layers_to_capture`` (each family has its own offset
    convention: Llama/Qwen add 1 to every id, DeepSeek/Kimi only when the first id is 1) and
    restores the model's state afterwards, so nothing about serving changes.
    """
    setter = getattr(stack.causal_lm, "set_eagle3_layers_to_capture", None)
    if setter is None:
        raise UnsupportedModel(
            f"hsdump: {stack.architecture} has no set_eagle3_layers_to_capture, so 'auto' "
            "layers cannot be resolved: set SGLANG_HS_DUMP_LAYERS explicitly"
        )
    with _restored_eagle3_state(stack.causal_lm):
        setter(list(draft_layer_ids) if draft_layer_ids is not None else None)
        layers = getattr(stack.inner, "layers_to_capture", None)
        if layers is None:  # Qwen2-MoE style keeps a per-layer flag too
            layers = [i for i, layer in enumerate(stack.layers)
                      if getattr(layer, "_is_layer_to_capture", False)]
        return [int(i) for i in layers]


def check_capture_points() -> list[str]:
    """Return what is missing in the installed SGLang for the patch to work (empty: all fine).

    Used by ``hsdump doctor`` at image build time, so a drifted base image fails the build.
    """
    problems: list[str] = []

    def resolve(dotted: str):
        module, _, attr = dotted.rpartition(".")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            problems.append(f"{dotted} is missing ({type(e).__name__}: {e})")
            return None

    for target in HOOK_TARGETS:
        owner, _, method = target.rpartition(".")
        cls = resolve(owner)
        if cls is not None and not hasattr(cls, method):
            problems.append(f"{target} is missing (hook target)")

    stage = resolve("sglang.srt.layers.layer_boundary.stage.StageBoundary")
    if stage is not None:
        prepare_attention = getattr(stage, "_prepare_attention", None)
        if prepare_attention is None or "capture_gathered" not in inspect.signature(
            prepare_attention
        ).parameters:
            problems.append(
                "StageBoundary._prepare_attention no longer accepts capture_gathered "
                "(the EAGLE-3 capture point the patch injects)"
            )
    fb = resolve("sglang.srt.model_executor.forward_batch_info.ForwardBatch")
    if fb is not None:
        fields = getattr(fb, "__dataclass_fields__", {})
        problems += [f"ForwardBatch.{f} is missing" for f in _FORWARD_BATCH_FIELDS
                     if f not in fields]
    mode = resolve("sglang.srt.model_executor.forward_batch_info.ForwardMode")
    if mode is not None and not hasattr(mode, "EXTEND"):
        problems.append("ForwardMode.EXTEND is missing")

    for module, classes, layer_cls in SUPPORTED_MODELS:
        for cls_name in classes:
            cls = resolve(f"{module}.{cls_name}")
            if cls is not None and not hasattr(cls, "set_eagle3_layers_to_capture"):
                problems.append(f"{module}.{cls_name}.set_eagle3_layers_to_capture is missing")
        if layer_cls:
            layer = resolve(f"{module}.{layer_cls}")
            if layer is not None and "attn_boundary.prepare" not in inspect.getsource(
                layer.forward
            ):
                problems.append(
                    f"{module}.{layer_cls}.forward no longer calls attn_boundary.prepare "
                    "(the capture point)"
                )
    return problems
