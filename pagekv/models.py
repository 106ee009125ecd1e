"""Model presets for planning and simulation: the shapes that decide a KV cache's size."""

from dataclasses import dataclass

from pagekv.spec import KVCacheSpec

__all__ = ["ModelShape", "PRESETS", "MAX_CONTEXT"]

MAX_CONTEXT = 131072  # longest context the simulator serves and a contiguous allocator reserves (128K)


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache and the cost model need to know about a model.

    Attributes
    ----------
    name : str
    num_layers, num_kv_heads, head_dim : int
    num_params : float
        Parameter count (weights read per decode step, FLOPs per prefill token).
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: float

    def spec(self, *, page_size=16, dtype="bfloat16") -> KVCacheSpec:
        """The KV-cache spec of this model at the given page size and storage dtype."""
        return KVCacheSpec(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, page_size=page_size, dtype=dtype)


# Published configurations (config.json of each model): layers, KV heads (GQA), head dimension.
PRESETS = {m.name: m for m in [
    ModelShape("llama-3-8b", 32, 8, 128, 8.0e9),
    ModelShape("llama-3-70b", 80, 8, 128, 70.6e9),
    ModelShape("qwen2.5-7b", 28, 4, 128, 7.6e9),
    ModelShape("mistral-7b", 32, 8, 128, 7.2e9),
]}
