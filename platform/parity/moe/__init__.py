"""MoE routing replay (R3): capture at rollout, compact transport, streaming decode, replay in training."""

from parity.moe.capture import RoutingRecorder
from parity.moe.codec import RoutingBatch, decode_routing, encode_routing, routing_dtype, routing_torch_dtype
from parity.moe.decode import DecodeStats, decode_naive, decode_streaming
from parity.moe.replay import (
    DISAGREEMENT,
    DISAGREEMENT_REPLAYED,
    RoutingReplay,
    check_routing_matches_model,
    enable_routing_replay,
    replayed_routing,
    rollout_replay_inputs,
    routing_disagreement,
    routing_disagreement_metrics,
    set_replay_routing,
)
from parity.moe.routers import RouterRef, find_moe_routers

__all__ = [
    "DISAGREEMENT", "DISAGREEMENT_REPLAYED", "DecodeStats", "RouterRef", "RoutingBatch", "RoutingRecorder",
    "RoutingReplay", "check_routing_matches_model", "decode_naive", "decode_routing", "decode_streaming", "enable_routing_replay",
    "encode_routing", "find_moe_routers", "replayed_routing", "rollout_replay_inputs", "routing_disagreement",
    "routing_disagreement_metrics", "routing_dtype", "routing_torch_dtype", "set_replay_routing",
]
