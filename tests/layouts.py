"""Every "parallel layout against one process" case, as data.

One runner reads them (``test_parallel_equivalence.py::test_layout_matches_single_process``, one
test id per case name): the trainer on ``helpers.BASE`` + ``model`` + ``layout`` on ``world``
spawned gloo ranks against one process on ``BASE`` + ``model`` (same seed and data), compared by
``helpers.check``: per-step losses and grad norms within 1e-5 relative, final parameters equal.
``test_the_cases_cover_what_the_package_registers`` (same module) fails when a pipeline schedule,
a ``parallel.cp_comm`` mode, a ZeRO stage or a parallel dimension the package accepts has no case
that CI runs.

A new layout, schedule or mode is one ``Case`` here. Its name stays stable: ``-k`` selects by it.
"""

from __future__ import annotations

from dataclasses import dataclass

from helpers import NEOX, OLMO3, OLMO3_YARN, QWEN


@dataclass(frozen=True)
class Case:
    """One layout against one process.

    - ``world``: the ranks it spawns;
    - ``layout``: the flags of the parallel run only: a layout, or an option that must not change
      the numbers (``optim.offload``);
    - ``model``: model, batch and data flags both runs take (the reference is computed once per
      distinct ``model``);
    - ``slow``: marked slow (CI leaves it out: it runs with ``-m slow``);
    - ``note``: what it is there for, where the name does not say.
    """
    name: str
    world: int
    layout: tuple[str, ...] = ()
    model: tuple[str, ...] = ()
    slow: bool = False
    note: str = ""


TP2_SP = ("--parallel.tp", "2", "--parallel.sequence_parallel", "true")
PP2 = ("--parallel.pp", "2")
VPP2 = ("--parallel.vpp", "2")
CP2 = ("--parallel.cp", "2")
Z3 = ("--parallel.zero", "3")
ZB_H1 = ("--parallel.pp_schedule", "zb_h1")
ZBV = ("--parallel.pp_schedule", "zbv")
TIED = ("--model.tie_embeddings", "true")
DOCS = ("--data.reset_attention_mask", "true", "--data.reset_position_ids", "true",
        "--data.eod_mask_loss", "true")

WINDOW = ("--model.sliding_window", "5", "--model.sliding_window_pattern", "2")


def _zero(stage: int, shard: int | None = None) -> tuple[str, ...]:
    shards = ("--parallel.zero_shard_size", str(shard)) if shard else ()
    return ("--parallel.zero", str(stage), *shards)


def _recompute(kind: str) -> tuple[str, ...]:
    return ("--parallel.recompute", kind)


def _cp_comm(mode: str) -> tuple[str, ...]:
    return ("--parallel.cp_comm", mode)


CASES: tuple[Case, ...] = (
    # -- tensor, data and pipeline parallelism, ZeRO 1 and 2, hybrid sharding
    Case("tp2_sp", 2, TP2_SP),
    Case("tp2_sp_overlap", 2, (*TP2_SP, "--parallel.tp_comm_overlap", "true"),
         note="the sequence-parallel collectives as ring steps under their GEMMs"),
    Case("dp2", 2),
    Case("dp2_zero1", 2, _zero(1)),
    Case("pp2", 2, PP2),
    Case("pp2_vpp2", 2, (*PP2, *VPP2)),
    Case("pp2_vpp2_3_micro", 2, (*PP2, *VPP2), ("--train.global_batch_size", "6"),
         note="3 micro-batches on 2 stages: the interleaved order's last group is one micro-batch"),
    Case("pp2_vpp2_empty_ends", 2, (*PP2, *VPP2, "--parallel.pipeline_layers", "[0, 2, 2, 0]"),
         note="Llama 3 405B's split: the first chunk the embedding alone, the last the output "
              "layer alone"),
    Case("pp2_gpipe_tied", 2, (*PP2, "--parallel.pp_schedule", "gpipe"), TIED),
    Case("tp2_dp2_zero1", 4, ("--parallel.tp", "2", *_zero(1)), slow=True),
    Case("pp4", 4, ("--parallel.pp", "4"), slow=True),
    Case("dp4_zero2", 4, _zero(2), slow=True),
    Case("dp4_zero1_shard2", 4, _zero(1, 2), slow=True,
         note="hybrid sharding: ZeRO over pairs of dp ranks, the pairs replicas of each other"),
    Case("dp4_zero2_shard2", 4, _zero(2, 2), slow=True),
    Case("dp2_zero1_shard1", 2, _zero(1, 1)),
    Case("tp2_pp2_dp2", 8, ("--parallel.tp", "2", *PP2, "--parallel.sequence_parallel", "true",
                            *_zero(1)), slow=True),
    # -- the zero-bubble schedules: split backward (B, then W in the bubble)
    Case("pp2_zb_h1", 2, (*PP2, *ZB_H1)),
    Case("pp2_zbv_tied", 2, (*PP2, *VPP2, *ZBV), TIED),
    Case("pp2_zb_h1_tied", 2, (*PP2, *ZB_H1), TIED),
    Case("pp2_dp2_zb_h1_zero2", 4, (*PP2, *ZB_H1, *_zero(2))),
    Case("pp2_dp2_zbv_zero1_recompute", 4, (*PP2, *VPP2, *ZBV, *_zero(1), *_recompute("full")),
         slow=True),
    Case("tp2_sp_pp2_zb_h1_selective", 4, (*TP2_SP, *PP2, *ZB_H1, *_recompute("selective")),
         slow=True),
    Case("pp2_dp2_zb_h1_zero3", 4, (*PP2, *ZB_H1, *Z3), slow=True),
    Case("pp4_zb_h1", 4, ("--parallel.pp", "4", *ZB_H1), slow=True),
    Case("pp4_zbv", 4, ("--parallel.pp", "4", *VPP2, *ZBV), ("--model.num_layers", "8"),
         slow=True),
    # -- context parallelism; every model has grouped-query attention (BASE: 4 query heads sharing
    # 2 kv heads), so the K/V all-gather moves the kv heads only and attention expands them
    Case("cp2", 2, CP2),
    Case("cp2_full_recompute", 2, (*CP2, *_recompute("full"))),
    Case("cp2_selective_recompute", 2, (*CP2, *_recompute("selective"))),
    Case("cp2_documents", 2, CP2, DOCS),
    Case("cp2_documents_full_recompute", 2, (*CP2, *_recompute("full")), DOCS),
    Case("cp4", 4, ("--parallel.cp", "4")),
    Case("tp2_cp2_sp", 4, (*TP2_SP, *CP2)),
    Case("cp2_pp2", 4, (*PP2, *CP2)),
    Case("cp2_dp2_zero1", 4, (*_zero(1), *CP2)),
    # the other two ways to reach the other cp rank's keys (parallel.cp_comm)
    Case("cp2_ring_documents", 2, (*CP2, *_cp_comm("ring")), DOCS),
    Case("cp2_a2a_selective_recompute", 2, (*CP2, *_cp_comm("a2a"), *_recompute("selective"))),
    Case("tp2_cp2_sp_ring", 4, (*TP2_SP, *CP2, *_cp_comm("ring")), slow=True),
    # -- ZeRO 3: fully sharded parameters
    Case("dp2_zero3", 2, Z3),
    Case("dp2_zero3_keep", 2, (*Z3, "--parallel.zero3_keep_gathered", "true")),
    Case("dp2_zero3_no_prefetch", 2, (*Z3, "--parallel.zero3_prefetch", "false")),
    Case("dp2_zero3_full_recompute", 2, (*Z3, *_recompute("full"))),
    Case("dp2_zero3_selective_recompute", 2, (*Z3, *_recompute("selective"))),
    Case("dp2_zero3_tied", 2, Z3, TIED),
    Case("dp2_zero3_offload", 2, (*Z3, "--optim.offload", "true")),
    Case("dp4_zero3", 4, Z3, slow=True),
    Case("tp2_dp2_sp_zero3", 4, (*Z3, *TP2_SP), slow=True),
    Case("pp2_dp2_1f1b_zero3", 4, (*Z3, *PP2), slow=True),
    Case("pp2_dp2_interleaved_zero3", 4, (*Z3, *PP2, *VPP2), slow=True),
    Case("dp4_shard2_zero3", 4, (*Z3, "--parallel.zero_shard_size", "2"), slow=True),
    Case("cp2_dp2_zero3", 4, (*Z3, *CP2), slow=True, note="sharded over dp × cp"),
    # -- document masking (attention inside each document of a packed sample) under tp + sp and pp
    Case("tp2_sp_documents", 2, TP2_SP, DOCS),
    Case("pp2_documents", 2, PP2, DOCS),
    # -- sliding-window attention: layers 0 and 2 windowed, 1 and 3 full (every 2nd layer full)
    Case("tp2_sp_window", 2, TP2_SP, WINDOW),
    Case("cp2_window", 2, CP2, WINDOW),
    Case("cp2_ring_window_documents", 2, (*CP2, *_cp_comm("ring")), (*WINDOW, *DOCS)),
    Case("cp2_a2a_window_selective", 2, (*CP2, *_cp_comm("a2a"), *_recompute("selective")), WINDOW),
    Case("pp2_window_documents_full_recompute", 2, (*PP2, *_recompute("full")), (*WINDOW, *DOCS)),
    # -- the other model families (helpers.QWEN: the Llama family's Qwen options; helpers.NEOX;
    # helpers.OLMO3, whose tp2 cases sum the QK-norm's statistics over the tp ranks)
    Case("olmo3_cp2_ring_documents", 2, (*CP2, *_cp_comm("ring")), (*OLMO3, *DOCS)),
    Case("olmo3_cp2_a2a", 2, (*CP2, *_cp_comm("a2a")), OLMO3),
    Case("olmo3_tp2_pp2_sp", 4, (*TP2_SP, *PP2), OLMO3, slow=True),
    Case("olmo3_yarn_cp2", 2, CP2, OLMO3_YARN, note="YaRN on the full layer, its own rotary on the windowed "
                                                    "ones: each layer's table, this rank's positions"),
    *(Case(f"{family}_{name}", 2, layout, flags)
      for family, flags in (("qwen", QWEN), ("gpt_neox", NEOX), ("olmo3", OLMO3))
      for name, layout in (("tp2_sp", TP2_SP), ("pp2", PP2), ("dp2_zero3", Z3), ("cp2", CP2),
                           ("pp2_vpp2_selective", (*PP2, *VPP2, *_recompute("selective"))),
                           ("dp2_zero1_full", (*_zero(1), *_recompute("full"))))),
)

BY_NAME: dict[str, Case] = {case.name: case for case in CASES}
