"""What serving one model is built of, besides its weights: its KV pool, the tiers below it and its decode graphs.
The engine builds them for its model, and the draft model (spec/draft_model.py) for its own."""
from __future__ import annotations

import logging
import os

import torch

from kvtier.config import Config
from kvtier.engine.graphs import DecodeGraphs
from kvtier.engine.runner import TORCH_THREADS
from kvtier.kv.keys import namespace
from kvtier.kv.manager import KVManager
from kvtier.kv.manifest import ManifestStore
from kvtier.kv.pager import Pager
from kvtier.kv.pool import KVPool, default_pool_tokens
from kvtier.kv.rates import rates_path
from kvtier.kv.tiers.disk import FINGERPRINTS
from kvtier.kv.tiers.host import HostTier
from kvtier.kv.tiers.stack import TierStack, extra_tiers
from kvtier.kv.tiers.staging import Staging
from kvtier.models.attention import triton_supports
from kvtier.models.config import ModelConfig
from kvtier.models.decoder import Decoder
from kvtier.models.ggml_decoder import GgmlDecodeSteps

log = logging.getLogger("kvtier.engine")

BUFFER_MAX_BYTES = 1 << 30      # the most host memory each of the mover's read buffers takes


def pool_tokens(config: Config, models: list[ModelConfig], device: torch.device, held: int, reserve: int = 0) -> int:
    """The tokens each pool holds: --kv-pool-tokens, else a share of free memory split between the model's pool and
    its drafter's (each holds as many tokens: every sequence the model runs fits in both). held: device bytes the
    model's weights take; reserve: those a drafter's weights will take."""
    per_token = sum(KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.kv_torch_dtype)
                    for mc in models)
    return config.kv_pool_tokens or default_pool_tokens(per_token, device, held, reserve,
                                                        config.gpu_memory_utilization)


def tier_share(drafter: ModelConfig, target: ModelConfig) -> float:
    """A drafter's part of the host and disk budgets beside its target's: its share of a token's K/V bytes."""
    def per_token(mc: ModelConfig) -> int:
        return mc.num_layers * mc.num_kv_heads * mc.head_dim
    return per_token(drafter) / (per_token(drafter) + per_token(target))


def build_pool(config: Config, mc: ModelConfig, fingerprint: str, device: torch.device, pool_tokens: int,
               role: str = "exact", values_transposed: bool = False) -> KVPool:
    """A model's device pool of pool_tokens tokens. role enters the namespace: the target's exact attention, or a
    drafter's blocks, which never share a key with it. values_transposed: for ggml's decode steps (`decodes_in_ggml`),
    whose payloads keep V transposed as the pool does, under a namespace of their own (`KVPool.layout`)."""
    ns = namespace(fingerprint, config.kv_namespace_dtype, config.block_size, KVPool.layout(values_transposed), role)
    pool = KVPool(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size,
                  pool_tokens, config.kv_torch_dtype, device, ns, config.prefix_cache, values_transposed)
    log.info("KV pool%s: %d blocks of %d tokens (%.2f GiB)", "" if role == "exact" else f" ({role})",
             pool.num_blocks, config.block_size, pool.num_blocks * pool.block_bytes / 2**30)
    return pool


def build_pager(config: Config, pool: KVPool, tiers: TierStack, head_dim: int, fingerprint: str,
                role: str = "exact", policy: str | None = None) -> Pager:
    """Bounded residency for a pool: the config's budget, sink and tail; its blocks computed over a partial resident
    set keyed in a namespace of their own (the role's: a drafter's never shares a key with the model's)."""
    policy = policy or config.kv_policy
    mode = (f"bounded(blocks={config.resident_blocks},sink={config.kv_sink_blocks},tail={config.kv_tail_blocks},"
            f"policy={policy},every={config.kv_reselect_every})")
    return Pager(pool, tiers.pinnable_bytes, config.resident_blocks, config.kv_sink_blocks, config.kv_tail_blocks,
                 policy, config.kv_reselect_every, head_dim ** -0.5, pool.namespace,
                 namespace(fingerprint, config.kv_namespace_dtype, config.block_size,
                           KVPool.layout(pool.values_transposed),
                           mode if role == "exact" else f"{role}-{mode}"))


def manifest_store(config: Config, pager: Pager, name: str = "manifests") -> ManifestStore:
    """Where a bounded pool's sequences leave their pager state: in memory, and beside the disk tier."""
    directory = disk_dir(config)
    return ManifestStore(pager.bounded_namespace, directory and os.path.join(directory, name))


def kv_manager(config: Config, pool: KVPool, tiers: TierStack, pager: Pager | None,
               manifests: ManifestStore | None) -> KVManager:
    """A pool's KV manager over its tiers (and pager and manifests under bounded residency), its side stores (partial
    blocks, rates) beside the disk tier's."""
    directory = disk_dir(config)
    return KVManager(pool, tiers, pager, manifests, directory and os.path.join(directory, "partials"),
                     directory and rates_path(os.path.join(directory, "rates"), pool.namespace, pool.device))


def build_kv(config: Config, pool: KVPool, max_model_len: int, share: float, head_dim: int,
             fingerprint: str, prompt_chunks: bool) -> KVManager:
    """A drafter's KV manager: over host and disk tiers with its share of their budgets, its side stores and
    manifests beside the disk tier's, as the model's. Under bounded residency its blocks are paged as the model's
    are, by recency (a drafter's attention only proposes: the verification decides). prompt_chunks: whether the
    drafter computes prompt chunks (a draft model does, a DFlash drafter writes its K/V from features)."""
    tiers = build_tier_stack(config, pool, max_model_len, share, prompt_chunks)
    # named after the model's policy too: a DFlash drafter's K/V follow the model's window
    pager = build_pager(config, pool, tiers, head_dim, fingerprint, f"draft-over-{config.kv_policy}", "lru") \
        if config.resident_blocks else None
    return kv_manager(config, pool, tiers, pager, pager and manifest_store(config, pager, "draft-manifests"))


def digest_cache(config: Config) -> str | None:
    """Where weight files' digests are remembered: beside the disk cache, whose namespace they name."""
    return os.path.join(os.path.expanduser(config.kv_disk_dir), FINGERPRINTS) if config.kv_disk else None


def decodes_in_ggml(config: Config, model: Decoder, device: torch.device) -> bool:
    """Whether the model's decode steps run as ggml graphs: on CPU, with quantized weights, unless eager."""
    return device.type == "cpu" and model.quantized and not config.enforce_eager


def decode_graphs(config: Config, model: Decoder, pool: KVPool, max_model_len: int,
                  feature_layers: tuple[int, ...] = ()) -> DecodeGraphs | GgmlDecodeSteps | None:
    """Decode steps captured as CUDA graphs, where the device and the Triton decode kernel allow them, handing back
    the outputs of feature_layers too (a DFlash drafter's); on CPU with quantized weights, decode steps as ggml
    graphs, which hand them back as well."""
    if decodes_in_ggml(config, model, pool.device):
        return GgmlDecodeSteps(model, pool, config.num_threads or TORCH_THREADS, feature_layers)
    if config.enforce_eager or pool.device.type == "cpu":
        return None
    if not triton_supports(model.config.head_dim, config.block_size):
        log.warning("decode runs eagerly: the Triton decode kernel cannot tile head size %d and block size %d "
                    "(or Triton is missing)", model.config.head_dim, config.block_size)
        return None
    try:
        rows_per_seq = 1 + config.num_speculative_tokens if config.speculative else 1
        return DecodeGraphs(model, pool, config.max_num_seqs, max_model_len, rows_per_seq=rows_per_seq,
                            feature_layers=feature_layers)
    except Exception:   # serve anyway, eagerly: slower, never wrong
        log.exception("capturing the decode graphs failed: decode runs eagerly")
        return None


def disk_dir(config: Config) -> str | None:
    """The disk tier's directory, None when the config leaves the tier out (manifests, partial blocks and rates are
    kept beside it)."""
    return os.path.expanduser(config.kv_disk_dir) if config.kv_disk and config.kv_disk_gib > 0 else None


def build_tier_stack(config: Config, pool: KVPool, max_model_len: int, share: float = 1.0,
                     prompt_chunks: bool = True) -> TierStack:
    """The tiers below the device that the config asks for, fastest first, and the mover's read buffers. share: the
    part of the host and disk budgets this pool's blocks may take (a draft model's pool takes the rest).
    prompt_chunks: whether the pool's prompt chunks need the buffer a bounded one gathers its paged-out K/V into."""
    tiers = []
    host = None
    if config.kv_host_gib > 0:
        host = HostTier(int(config.kv_host_gib * share * 2**30), pool.block_shape, pool.dtype,
                        pin_memory=pool.device.type == "cuda")
        tiers.append(host)
    if directory := disk_dir(config):
        from kvtier.kv.tiers.disk import DiskTier
        tiers.append(DiskTier(directory, int(config.kv_disk_gib * share * 2**30),
                              pool.namespace, pool.block_shape, pool.dtype))
    tiers += extra_tiers(config, pool)
    below_host = len(tiers) - (host is not None)
    # each read buffer holds a whole context's blocks (a longer read goes to fresh memory), carved from the host tier,
    # each at most an eighth of its budget; with the host tier off, the tiers below read into one buffer of their own
    size = min(BUFFER_MAX_BYTES, pool.blocks_for(max_model_len) * pool.block_bytes)
    if host is None:
        cuda = pool.device.type == "cuda"
        return TierStack(tiers, Staging(torch.empty(size, dtype=torch.uint8, pin_memory=cuda)) if below_host else None)
    size = min(size, host.budget_bytes // 8 // pool.block_bytes * pool.block_bytes)
    staging = Staging(host.carve(size)) if size and below_host else None
    gather = Staging(host.carve(size)) if size and config.resident_blocks and prompt_chunks else None
    return TierStack(tiers, staging, gather)
