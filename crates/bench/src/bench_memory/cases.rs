//! The cases of `bench-memory`: what each one trains with (optimizer and implementation,
//! in-backward stepping, clipping, checkpointing, offload, compression, autocast, loss scaling,
//! parameter dtype), their names on the command line and PyTorch's, and the optimizer a case
//! builds ([`BenchOptimizer`]: one that can count its state while the training loop steps it).
//!
//! It sits on optim (the optimizers) and hooks' clipping modes; it knows nothing about models,
//! devices, the protocol or reports.

use std::sync::Arc;

use anyhow::{Context, Result};
use headroom_autograd_core::{DType, Tensor};
use headroom_hooks::ClipMode;
use headroom_optim::kernels::{
    is_quantized_4bit, Adam4bitConfig, Adam8bitConfig, AdamConfig, Bf16Rounding, SgdConfig,
    StepOutcome, AO_BLOCK_SIZE,
};
use headroom_optim::{
    AdamStochasticConfig, GroupOptimizer, Implementation, OffloadConfig, OffloadStepper,
    OffloadedAdam, OptimError, Optimizer, ParamGroup, ParamId, Scaling, StepParams,
    StreamedOptimizer, UpdateRule,
};
use parking_lot::Mutex;

use super::training::tensor_bytes;

/// One optimizer implementation under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Case {
    /// Adam (lr 1e-4), foreach with temporaries bounded to [`headroom_optim::DEFAULT_FOREACH_CHUNK`].
    AdamForeach,
    /// Adam, foreach as PyTorch does it: temporaries for the whole parameter list.
    AdamForeachUnbounded,
    /// Adam, one parameter at a time (`foreach=False`).
    AdamSingle,
    /// Adam, one fused pass (`fused=True`).
    AdamFused,
    /// bitsandbytes' Adam8bit (lr 1e-4): 8-bit blockwise state.
    Adam8bit,
    /// SGD (lr 1e-3, no momentum), fused: no state, no temporaries.
    Sgd,
    /// Fused Adam stepped inside backward (hooks' `InBackward`, buckets of 25 MiB or 1/16 of the
    /// parameters, whichever is smaller): gradients are freed as they are used.
    AdamInbwd,
    /// 8-bit Adam stepped inside backward.
    Adam8bitInbwd,
    /// Fused Adam with every encoder block but the last checkpointed (only block inputs kept;
    /// `CheckpointBlocks::all_but_last`).
    AdamCkpt,
    /// Fused Adam inside backward with every block checkpointed (the last one too: leaving it
    /// alone would put the peak at the end of the forward).
    AdamInbwdCkpt,
    /// Fused Adam after `clip_grad_norm_(params, 1.0)` (L2): the plain loop's clipping.
    AdamFusedClip,
    /// Fused Adam inside backward, clipped exactly to the global L2 norm 1.0 (a first backward
    /// pass measures the norm, a second one updates).
    AdamInbwdClip,
    /// Fused Adam inside backward, clipped with the previous step's global L2 norm (one pass).
    AdamInbwdClipPrev,
    /// Fused Adam with the saved tensors of the first 7/12 of the encoder blocks offloaded to
    /// pinned host memory ([`super::training::offload_blocks`]; CUDA only).
    AdamOffload,
    /// Fused Adam with the first blocks recomputed (`--checkpoint-blocks`, default a third), the
    /// saves of most blocks after them offloaded to pinned host memory, their copies overlapping
    /// the later blocks, and the last few kept ([`super::training::offload_checkpoint_blocks`];
    /// CUDA only): exact, below uniform checkpointing's step time at about its peak.
    AdamOffloadCkpt,
    /// Fused Adam with every encoder block's saved activations compressed to 8 bits (checkpoint's
    /// `CompressBlocks::all()`: no checkpointing; each op input or output a block saves, of 16 Ki
    /// elements or more, kept as signed bytes with one f32 absmax per 256 elements and decoded in
    /// backward; parameters, layer norm statistics and attention's log-sum-exp stay f32).
    AdamCkpt8bit,
    /// Fused Adam with checkpointing planned per block for a memory budget (`--budget`;
    /// [`super::budget_plan`]).
    AdamAuto,
    /// Fused Adam with the forward under bf16 autocast.
    AdamBf16,
    /// Fused Adam with the forward under f16 autocast and the loss scaled by a GradScaler (the
    /// kernels unscale and skip; no host read).
    AdamFp16,
    /// Fused Adam inside backward, every block checkpointed, the forward under bf16 autocast.
    AdamInbwdCkptBf16,
    /// Fused Adam with the forward under bf16 autocast and every linear but the head in fp8.
    AdamFp8,
    /// `AdamInbwdCkptBf16` with every linear but the head in fp8.
    AdamInbwdCkptFp8,
    /// Fused Adam inside backward (no checkpointing), bf16 autocast with every linear but the
    /// head in fp8.
    AdamInbwdFp8,
    /// Forward and backward only (no optimizer step; gradients set to none after), f32.
    FwdBwd,
    /// Forward and backward only, the whole model in bf16 (`model.bfloat16()`).
    FwdBwdBf16,
    /// Forward and backward only, the whole model in bf16, every block checkpointed (the last
    /// one too, as Hugging Face's `gradient_checkpointing_enable()` does).
    FwdBwdBf16Ckpt,
    /// The whole model in bf16 with no master copy, every block checkpointed, 8-bit AdamW
    /// (lr 1e-4) rounding the parameters stochastically (PyTorch: torchao's `AdamW8bit` with
    /// `bf16_stochastic_round=True`).
    Adamw8bitBf16Ckpt,
    /// The same, 8-bit AdamW stepped inside backward.
    Adamw8bitInbwdBf16Ckpt,
    /// The whole model in bf16 with no master copy, every block checkpointed, torchao's 4-bit
    /// AdamW (lr 1e-4) rounding the parameters stochastically.
    Adamw4bitBf16Ckpt,
    /// The same, 4-bit AdamW stepped inside backward.
    Adamw4bitInbwdBf16Ckpt,
    /// 4-bit AdamW inside backward on the bf16 model with every activation kept: what the
    /// memory the optimizer saves buys in speed.
    Adamw4bitInbwdBf16,
    /// 8-bit AdamW on the bf16 model with every activation kept, stepped after backward: the
    /// plain recipe at batches where checkpointing is not needed to fit.
    Adamw8bitBf16,
    /// 8-bit AdamW inside backward on the bf16 model with every activation kept.
    Adamw8bitInbwdBf16,
    /// 4-bit AdamW on the bf16 model with every activation kept, stepped after backward.
    Adamw4bitBf16,
    /// AdamW with f32 moments on the GPU, the bf16 model rounded stochastically (optim's
    /// `AdamStochastic`; torchao's `_AdamW(bf16_stochastic_round=True)`), stepped inside
    /// backward, every activation kept: the on-device step the offloaded one is measured against.
    AdamwInbwdBf16,
    /// The same AdamW with its state in host memory (optim's `OffloadedAdam`), stepped by the
    /// host bucket by bucket inside backward (PyTorch: torchao's `CPUOffloadOptimizer` with
    /// `offload_gradients=True`).
    AdamwOffloadInbwdBf16,
    /// The same AdamW with its moments in pinned host memory, streamed through the GPU, which
    /// steps them bucket by bucket inside backward (`OffloadStepper::Device`), holding up to a
    /// quarter of them at once (`stream_bytes`).
    AdamwOffloadStreamInbwdBf16,
    /// 4-bit AdamW inside backward on the bf16 model, every activation kept, its state in
    /// pinned host memory between steps and streamed through the GPU bucket by bucket (optim's
    /// `StreamedOptimizer`; at most a quarter of it, and 256 MiB, coming in at once): the GPU
    /// holds only the state in flight.
    Adamw4bitStreamInbwdBf16,
    /// The same, every block checkpointed: the largest-model recipe.
    Adamw4bitStreamInbwdBf16Ckpt,
}

impl Case {
    /// Every case, in report order: pairs that differ by one technique sit next to each other
    /// (the HTML report draws two timelines a row).
    pub(crate) const ALL: [Case; 39] = [
        Case::AdamForeach,
        Case::AdamForeachUnbounded,
        Case::AdamSingle,
        Case::Sgd,
        Case::AdamFused,
        Case::AdamInbwd,
        Case::Adam8bit,
        Case::Adam8bitInbwd,
        Case::AdamCkpt,
        Case::AdamInbwdCkpt,
        Case::AdamFusedClip,
        Case::AdamInbwdClip,
        Case::AdamInbwdClipPrev,
        Case::AdamOffload,
        Case::AdamOffloadCkpt,
        Case::AdamCkpt8bit,
        Case::AdamAuto,
        Case::AdamBf16,
        Case::AdamFp16,
        Case::AdamInbwdCkptBf16,
        Case::AdamFp8,
        Case::AdamInbwdCkptFp8,
        Case::AdamInbwdFp8,
        Case::FwdBwd,
        Case::FwdBwdBf16,
        Case::FwdBwdBf16Ckpt,
        Case::Adamw8bitBf16Ckpt,
        Case::Adamw8bitInbwdBf16Ckpt,
        Case::Adamw4bitBf16Ckpt,
        Case::Adamw4bitInbwdBf16Ckpt,
        Case::Adamw8bitBf16,
        Case::Adamw8bitInbwdBf16,
        Case::Adamw4bitBf16,
        Case::Adamw4bitInbwdBf16,
        Case::AdamwInbwdBf16,
        Case::AdamwOffloadInbwdBf16,
        Case::AdamwOffloadStreamInbwdBf16,
        Case::Adamw4bitStreamInbwdBf16,
        Case::Adamw4bitStreamInbwdBf16Ckpt,
    ];

    /// The case's name on the command line and in reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Case::AdamForeach => "adam_foreach",
            Case::AdamForeachUnbounded => "adam_foreach_unbounded",
            Case::AdamSingle => "adam_single",
            Case::AdamFused => "adam_fused",
            Case::Adam8bit => "adam8bit",
            Case::Sgd => "sgd",
            Case::AdamInbwd => "adam_inbwd",
            Case::Adam8bitInbwd => "adam8bit_inbwd",
            Case::AdamCkpt => "adam_ckpt",
            Case::AdamInbwdCkpt => "adam_inbwd_ckpt",
            Case::AdamFusedClip => "adam_fused_clip",
            Case::AdamInbwdClip => "adam_inbwd_clip",
            Case::AdamInbwdClipPrev => "adam_inbwd_clip_prev",
            Case::AdamOffload => "adam_offload",
            Case::AdamOffloadCkpt => "adam_offload_ckpt",
            Case::AdamCkpt8bit => "adam_ckpt8bit",
            Case::AdamAuto => "adam_auto",
            Case::AdamBf16 => "adam_bf16",
            Case::AdamFp16 => "adam_fp16",
            Case::AdamInbwdCkptBf16 => "adam_inbwd_ckpt_bf16",
            Case::AdamFp8 => "adam_fp8",
            Case::AdamInbwdCkptFp8 => "adam_inbwd_ckpt_fp8",
            Case::AdamInbwdFp8 => "adam_inbwd_fp8",
            Case::FwdBwd => "fwd_bwd",
            Case::FwdBwdBf16 => "fwd_bwd_bf16",
            Case::FwdBwdBf16Ckpt => "fwd_bwd_bf16_ckpt",
            Case::Adamw8bitBf16Ckpt => "adamw8bit_bf16_ckpt",
            Case::Adamw8bitInbwdBf16Ckpt => "adamw8bit_inbwd_bf16_ckpt",
            Case::Adamw4bitBf16Ckpt => "adamw4bit_bf16_ckpt",
            Case::Adamw4bitInbwdBf16Ckpt => "adamw4bit_inbwd_bf16_ckpt",
            Case::Adamw4bitInbwdBf16 => "adamw4bit_inbwd_bf16",
            Case::Adamw8bitBf16 => "adamw8bit_bf16",
            Case::Adamw8bitInbwdBf16 => "adamw8bit_inbwd_bf16",
            Case::Adamw4bitBf16 => "adamw4bit_bf16",
            Case::AdamwInbwdBf16 => "adamw_inbwd_bf16",
            Case::AdamwOffloadInbwdBf16 => "adamw_offload_inbwd_bf16",
            Case::AdamwOffloadStreamInbwdBf16 => "adamw_offload_stream_inbwd_bf16",
            Case::Adamw4bitStreamInbwdBf16 => "adamw4bit_stream_inbwd_bf16",
            Case::Adamw4bitStreamInbwdBf16Ckpt => "adamw4bit_stream_inbwd_bf16_ckpt",
        }
    }

    /// What the case trains with, in a line: its entry in `--help`'s list of cases.
    pub(crate) fn summary(self) -> &'static str {
        match self {
            Case::AdamForeach => "Adam, foreach with bounded temporaries",
            Case::AdamForeachUnbounded => {
                "Adam, foreach with temporaries for every parameter (PyTorch's)"
            }
            Case::AdamSingle => "Adam, one parameter at a time",
            Case::AdamFused => "Adam, one fused pass",
            Case::Adam8bit => "bitsandbytes' 8-bit Adam (blockwise 8-bit state)",
            Case::Sgd => "SGD, fused, no momentum: no state",
            Case::AdamInbwd => "fused Adam stepped inside backward (gradients freed as used)",
            Case::Adam8bitInbwd => "8-bit Adam stepped inside backward",
            Case::AdamCkpt => {
                "fused Adam, every block but the last checkpointed (recomputing the last would \
                 free nothing)"
            }
            Case::AdamInbwdCkpt => "fused Adam inside backward, every block checkpointed",
            Case::AdamFusedClip => "fused Adam after clip_grad_norm_ to 1.0",
            Case::AdamInbwdClip => {
                "fused Adam inside backward, clipped exactly (a measuring pass first)"
            }
            Case::AdamInbwdClipPrev => {
                "fused Adam inside backward, clipped with the previous step's norm"
            }
            Case::AdamOffload => {
                "fused Adam, the first 7/12 of the blocks' saves offloaded to pinned host memory \
                 (CUDA only)"
            }
            Case::AdamOffloadCkpt => {
                "fused Adam, the first third of the blocks checkpointed (--checkpoint-blocks), most \
                 of the others' saves offloaded to pinned host memory behind later blocks, the \
                 last kept (CUDA only; exact)"
            }
            Case::AdamCkpt8bit => "fused Adam, every block's saves compressed to 8 bits (lossy)",
            Case::AdamAuto => {
                "fused Adam, per block keep, recompute, 8-bit compression or (CUDA) offload, \
                 planned for --budget; measured beside uniform every-k checkpointing"
            }
            Case::AdamBf16 => "fused Adam, the forward under bf16 autocast",
            Case::AdamFp16 => "fused Adam, f16 autocast and a GradScaler",
            Case::AdamInbwdCkptBf16 => {
                "fused Adam inside backward, every block checkpointed, bf16 autocast"
            }
            Case::AdamFp8 => {
                "fused Adam, bf16 autocast with every linear but the head in fp8 (E4M3 forward, \
                 E5M2 gradients, tensorwise scales, inputs saved in one byte)"
            }
            Case::AdamInbwdCkptFp8 => {
                "fused Adam inside backward, every block checkpointed, bf16 autocast with every \
                 linear but the head in fp8"
            }
            Case::AdamInbwdFp8 => {
                "fused Adam inside backward (gradients freed as used), bf16 autocast with every \
                 linear but the head in fp8"
            }
            Case::FwdBwd => "forward and backward only, f32",
            Case::FwdBwdBf16 => "forward and backward only, the whole model in bf16",
            Case::FwdBwdBf16Ckpt => {
                "forward and backward only, the whole model in bf16, every block checkpointed \
                 (Hugging Face's gradient_checkpointing_enable())"
            }
            Case::Adamw8bitBf16Ckpt => {
                "8-bit AdamW on the bf16 model (no master copy, stochastic rounding), every block \
                 checkpointed"
            }
            Case::Adamw8bitInbwdBf16Ckpt => {
                "8-bit AdamW inside backward on the bf16 model, every block checkpointed"
            }
            Case::Adamw4bitBf16Ckpt => {
                "4-bit AdamW on the bf16 model (no master copy, stochastic rounding), every block \
                 checkpointed"
            }
            Case::Adamw4bitInbwdBf16Ckpt => {
                "4-bit AdamW inside backward on the bf16 model, every block checkpointed"
            }
            Case::Adamw4bitInbwdBf16 => {
                "4-bit AdamW inside backward on the bf16 model, every activation kept"
            }
            Case::Adamw8bitBf16 => {
                "8-bit AdamW on the bf16 model (no master copy, stochastic rounding), every \
                 activation kept"
            }
            Case::Adamw8bitInbwdBf16 => {
                "8-bit AdamW inside backward on the bf16 model, every activation kept"
            }
            Case::Adamw4bitBf16 => {
                "4-bit AdamW on the bf16 model (no master copy, stochastic rounding), every \
                 activation kept"
            }
            Case::AdamwInbwdBf16 => {
                "AdamW (f32 moments) inside backward on the bf16 model (stochastic rounding), \
                 every activation kept"
            }
            Case::AdamwOffloadInbwdBf16 => {
                "the same AdamW with its state in host memory, stepped by the host inside \
                 backward (CUDA: gradients out and parameters back on side streams)"
            }
            Case::AdamwOffloadStreamInbwdBf16 => {
                "the same AdamW with its moments in pinned host memory, streamed in and out and \
                 stepped by the GPU inside backward (a quarter of them on the GPU at once)"
            }
            Case::Adamw4bitStreamInbwdBf16 => {
                "4-bit AdamW inside backward on the bf16 model, every activation kept, its state \
                 in pinned host memory streamed through the GPU"
            }
            Case::Adamw4bitStreamInbwdBf16Ckpt => {
                "4-bit AdamW inside backward on the bf16 model, every block checkpointed, its \
                 state in pinned host memory streamed through the GPU"
            }
        }
    }

    /// Whether the optimizer steps inside backward.
    pub(crate) fn in_backward(self) -> bool {
        matches!(
            self,
            Case::AdamInbwd
                | Case::Adam8bitInbwd
                | Case::AdamInbwdCkpt
                | Case::AdamInbwdClip
                | Case::AdamInbwdClipPrev
                | Case::AdamInbwdCkptBf16
                | Case::AdamInbwdCkptFp8
                | Case::AdamInbwdFp8
                | Case::Adamw8bitInbwdBf16Ckpt
                | Case::Adamw4bitInbwdBf16Ckpt
                | Case::Adamw4bitInbwdBf16
                | Case::Adamw8bitInbwdBf16
                | Case::AdamwInbwdBf16
                | Case::AdamwOffloadInbwdBf16
                | Case::AdamwOffloadStreamInbwdBf16
                | Case::Adamw4bitStreamInbwdBf16
                | Case::Adamw4bitStreamInbwdBf16Ckpt
        )
    }

    /// How the case clips gradients to the global L2 norm [`super::training::CLIP_MAX_NORM`], if it does.
    pub(crate) fn clipping(self) -> Option<ClipMode> {
        match self {
            Case::AdamFusedClip | Case::AdamInbwdClip => Some(ClipMode::Exact),
            Case::AdamInbwdClipPrev => Some(ClipMode::PreviousStep),
            _ => None,
        }
    }

    /// Whether the encoder blocks are checkpointed (with the plain step every one but the last).
    pub(crate) fn checkpointed(self) -> bool {
        matches!(
            self,
            Case::AdamCkpt
                | Case::AdamOffloadCkpt
                | Case::AdamInbwdCkpt
                | Case::AdamInbwdCkptBf16
                | Case::AdamInbwdCkptFp8
                | Case::FwdBwdBf16Ckpt
                | Case::Adamw8bitBf16Ckpt
                | Case::Adamw8bitInbwdBf16Ckpt
                | Case::Adamw4bitBf16Ckpt
                | Case::Adamw4bitInbwdBf16Ckpt
                | Case::Adamw4bitStreamInbwdBf16Ckpt
        )
    }

    /// Whether a checkpointed case recomputes the last block too: stepping in backward (no
    /// gradients pile up, so the last block's saves would set the peak at the end of the
    /// forward), and the bf16-model cases, which checkpoint as Hugging Face does.
    pub(crate) fn checkpoints_the_last_block(self) -> bool {
        self.in_backward()
            || matches!(
                self,
                Case::FwdBwdBf16Ckpt | Case::Adamw8bitBf16Ckpt | Case::Adamw4bitBf16Ckpt
            )
    }

    /// Whether the forward runs every linear but the head in fp8 (amp's `Float8Policy` over the
    /// case's autocast).
    pub(crate) fn float8(self) -> bool {
        matches!(
            self,
            Case::AdamFp8 | Case::AdamInbwdCkptFp8 | Case::AdamInbwdFp8
        )
    }

    /// The autocast dtype of the forward, if any.
    pub(crate) fn autocast(self) -> Option<DType> {
        match self {
            Case::AdamBf16
            | Case::AdamInbwdCkptBf16
            | Case::AdamFp8
            | Case::AdamInbwdCkptFp8
            | Case::AdamInbwdFp8 => Some(DType::BF16),
            Case::AdamFp16 => Some(DType::F16),
            _ => None,
        }
    }

    /// The dtype of the model's parameters.
    pub(crate) fn param_dtype(self) -> DType {
        match self {
            Case::FwdBwdBf16
            | Case::FwdBwdBf16Ckpt
            | Case::Adamw8bitBf16Ckpt
            | Case::Adamw8bitInbwdBf16Ckpt
            | Case::Adamw4bitBf16Ckpt
            | Case::Adamw4bitInbwdBf16Ckpt
            | Case::Adamw4bitInbwdBf16
            | Case::Adamw8bitBf16
            | Case::Adamw8bitInbwdBf16
            | Case::Adamw4bitBf16
            | Case::AdamwInbwdBf16
            | Case::AdamwOffloadInbwdBf16
            | Case::AdamwOffloadStreamInbwdBf16
            | Case::Adamw4bitStreamInbwdBf16
            | Case::Adamw4bitStreamInbwdBf16Ckpt => DType::BF16,
            _ => DType::F32,
        }
    }

    /// Whether the case steps no optimizer (forward and backward only).
    pub(crate) fn forward_backward_only(self) -> bool {
        matches!(self, Case::FwdBwd | Case::FwdBwdBf16 | Case::FwdBwdBf16Ckpt)
    }

    /// Whether the loss is scaled by a GradScaler (f16).
    pub(crate) fn loss_scaled(self) -> bool {
        self == Case::AdamFp16
    }

    /// Whether the case runs on a CUDA device only (offload copies to pinned host memory).
    pub(crate) fn needs_cuda(self) -> bool {
        self.why_cuda().is_some()
    }

    /// Why the case needs a CUDA device; `None` when the CPU runs it too.
    pub(crate) fn why_cuda(self) -> Option<&'static str> {
        match self {
            Case::AdamOffload | Case::AdamOffloadCkpt => Some(
                "it offloads activations to pinned host memory over CUDA copies, which the CPU \
                 backend has no use for",
            ),
            _ => None,
        }
    }

    /// `Ok` unless `cases` (from `--cases`) name a case that needs CUDA and `cuda` is false:
    /// then an error naming every such case and why, before anything runs.
    pub(crate) fn refuse_cuda_only(cases: &[Case], cuda: bool) -> Result<()> {
        let refused: Vec<Case> = cases
            .iter()
            .copied()
            .filter(|case| case.needs_cuda())
            .collect();
        if cuda || refused.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = refused.iter().map(|case| case.name()).collect();
        let reasons: Vec<String> = refused
            .iter()
            .filter_map(|case| Some(format!("{}: {}", case.name(), case.why_cuda()?)))
            .collect();
        anyhow::bail!(
            "--cases {}: {} a CUDA device ({}), and this run is on the CPU backend (--device \
             cpu, or no CUDA device answered); leave {} out of --cases, or run on a GPU",
            names.join(","),
            if refused.len() == 1 { "needs" } else { "need" },
            reasons.join("; "),
            if refused.len() == 1 { "it" } else { "them" },
        )
    }

    /// The case of `torch_reference.py` that computes the same update (PyTorch's foreach is
    /// unbounded, so both foreach cases compare with it).
    pub(crate) fn pytorch_name(self) -> &'static str {
        match self {
            Case::AdamForeachUnbounded => "adam_foreach",
            other => other.name(),
        }
    }

    /// The case named `name`.
    pub(crate) fn parse(name: &str) -> Result<Case> {
        Case::ALL
            .into_iter()
            .find(|case| case.name() == name)
            .with_context(|| {
                let names: Vec<_> = Case::ALL.iter().map(|c| c.name()).collect();
                format!("unknown case `{name}` (cases: {})", names.join(", "))
            })
    }

    /// The optimizer the case steps, over `params`, with no state yet.
    /// The case's optimizer over `params`; the streamed cases hold at most `stream_budget`
    /// bytes of state coming in (`None`: their own budget).
    pub(super) fn optimizer(
        self,
        params: Vec<Tensor>,
        stream_budget: Option<u64>,
    ) -> Result<Box<dyn BenchOptimizer>> {
        fn build<R: UpdateRule>(
            params: Vec<Tensor>,
            config: R,
            implementation: Implementation,
        ) -> Result<Box<dyn BenchOptimizer>> {
            let optimizer =
                GroupOptimizer::new(vec![ParamGroup::new(params, config)], implementation)?;
            Ok(Box::new(Arc::new(Mutex::new(optimizer))))
        }
        let adam = AdamConfig {
            lr: 1e-4,
            ..AdamConfig::adam()
        };
        let adam8bit = Adam8bitConfig {
            lr: 1e-4,
            ..Adam8bitConfig::adam()
        };
        // The bf16-model cases: AdamW, parameters rounded stochastically (torchao's
        // `bf16_stochastic_round=True`).
        let stochastic = Bf16Rounding::Stochastic { seed: 0 };
        let adamw8bit = Adam8bitConfig {
            lr: 1e-4,
            bf16_rounding: stochastic,
            ..Adam8bitConfig::adamw()
        };
        let adamw = AdamConfig {
            lr: 1e-4,
            ..AdamConfig::adamw()
        };
        let adamw4bit = Adam4bitConfig {
            lr: 1e-4,
            bf16_rounding: stochastic,
            ..Adam4bitConfig::adamw()
        };
        match self {
            Case::AdamForeach => build::<AdamConfig>(params, adam, Implementation::FOREACH),
            Case::AdamForeachUnbounded => {
                build::<AdamConfig>(params, adam, Implementation::ForeachUnbounded)
            }
            Case::AdamSingle => build::<AdamConfig>(params, adam, Implementation::Single),
            Case::AdamFused
            | Case::AdamInbwd
            | Case::AdamCkpt
            | Case::AdamInbwdCkpt
            | Case::AdamFusedClip
            | Case::AdamInbwdClip
            | Case::AdamInbwdClipPrev
            | Case::AdamOffload
            | Case::AdamOffloadCkpt
            | Case::AdamCkpt8bit
            | Case::AdamAuto
            | Case::AdamBf16
            | Case::AdamFp16
            | Case::AdamInbwdCkptBf16
            | Case::AdamFp8
            | Case::AdamInbwdCkptFp8
            | Case::AdamInbwdFp8 => build::<AdamConfig>(params, adam, Implementation::Fused),
            Case::Adam8bit | Case::Adam8bitInbwd => {
                build::<Adam8bitConfig>(params, adam8bit, Implementation::Fused)
            }
            Case::Adamw8bitBf16Ckpt
            | Case::Adamw8bitInbwdBf16Ckpt
            | Case::Adamw8bitBf16
            | Case::Adamw8bitInbwdBf16 => {
                build::<Adam8bitConfig>(params, adamw8bit, Implementation::Fused)
            }
            Case::Adamw4bitBf16Ckpt
            | Case::Adamw4bitInbwdBf16Ckpt
            | Case::Adamw4bitInbwdBf16
            | Case::Adamw4bitBf16 => {
                build::<Adam4bitConfig>(params, adamw4bit, Implementation::Fused)
            }
            Case::AdamwInbwdBf16 => build::<AdamStochasticConfig>(
                params,
                AdamStochasticConfig::new(adamw, 0),
                Implementation::Fused,
            ),
            Case::Adamw4bitStreamInbwdBf16 | Case::Adamw4bitStreamInbwdBf16Ckpt => {
                let budget = stream_budget
                    .unwrap_or_else(|| streamed_state_budget(params.iter().map(Tensor::numel)));
                Ok(Box::new(Arc::new(Mutex::new(StreamedOptimizer::new(
                    vec![ParamGroup::new(params, adamw4bit)],
                    Implementation::Fused,
                    budget,
                )?))))
            }
            Case::AdamwOffloadInbwdBf16 | Case::AdamwOffloadStreamInbwdBf16 => {
                let stepper = match self {
                    Case::AdamwOffloadStreamInbwdBf16 => OffloadStepper::Device,
                    _ => OffloadStepper::Host,
                };
                // The streamed case lets the GPU hold a quarter of the moments at once (f32
                // `exp_avg` and `exp_avg_sq`, 8 bytes a parameter): enough to start the copies
                // in during the forward.
                let moments: u64 = params.iter().map(|p| 8 * p.numel() as u64).sum();
                let config = OffloadConfig {
                    stepper,
                    stream_bytes: stream_budget.unwrap_or(moments / 4),
                    ..OffloadConfig::new(adamw)
                };
                Ok(Box::new(Arc::new(Mutex::new(OffloadedAdam::new(
                    params, config,
                )?))))
            }
            // The forward-and-backward cases never step: their SGD only sets gradients to none.
            Case::Sgd | Case::FwdBwd | Case::FwdBwdBf16 | Case::FwdBwdBf16Ckpt => {
                build::<SgdConfig>(params, SgdConfig::new(1e-3), Implementation::Fused)
            }
        }
    }
}

/// `--cases`' values: every case by its name, with its summary (clap's help lists them, and its
/// error for an unknown name names them).
impl clap::ValueEnum for Case {
    fn value_variants<'a>() -> &'a [Case] {
        &Case::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()).help(self.summary()))
    }
}

/// The stream budget of the streamed 4-bit cases for parameters of `sizes` elements: a quarter
/// of their state (4-bit codes and two f32 scales a block of 128 for a quantised parameter,
/// about 1.06 bytes a parameter; two f32 moments for another), at most 256 MiB (about one
/// Llama-3.1-8B block's state: the next bucket comes in while one is stepped, and the state on
/// the GPU stays a small, predictable share of the peak).
pub(crate) fn streamed_state_budget(sizes: impl Iterator<Item = usize>) -> u64 {
    (sizes.map(adam4bit_state_bytes).sum::<u64>() / 4).min(256 << 20)
}

/// Bytes of 4-bit AdamW's state for a parameter of `n` elements: two arrays of packed codes and
/// two f32 scales per block of 128 when quantised, else two f32 moments.
pub(crate) fn adam4bit_state_bytes(n: usize) -> u64 {
    match is_quantized_4bit(n) {
        true => n as u64 + 8 * (n / AO_BLOCK_SIZE) as u64,
        false => 8 * n as u64,
    }
}

/// An optimizer whose state can be counted, shared so that an `InBackward` can step it.
pub(super) trait BenchOptimizer: Send {
    /// A handle that steps the optimizer (through the shared lock).
    fn handle(&self) -> Box<dyn Optimizer>;
    /// Bytes of every state tensor on the device (numel × element size).
    fn state_bytes(&self) -> u64;
    /// Bytes of state the optimizer keeps in host memory (0 unless it offloads).
    fn host_state_bytes(&self) -> u64 {
        0
    }
}

impl BenchOptimizer for Arc<Mutex<OffloadedAdam>> {
    fn handle(&self) -> Box<dyn Optimizer> {
        Box::new(SharedOptimizer(Arc::clone(self)))
    }

    fn state_bytes(&self) -> u64 {
        0
    }

    fn host_state_bytes(&self) -> u64 {
        self.lock().host_state_bytes()
    }
}

impl<R: UpdateRule> BenchOptimizer for Arc<Mutex<StreamedOptimizer<R>>> {
    fn handle(&self) -> Box<dyn Optimizer> {
        Box::new(SharedOptimizer(Arc::clone(self)))
    }

    /// The inner optimizer's states: none between steps on CUDA (they are in host memory), all
    /// of them on the CPU (where the wrapper steps as the inner optimizer).
    fn state_bytes(&self) -> u64 {
        group_state_bytes(self.lock().inner())
    }

    fn host_state_bytes(&self) -> u64 {
        self.lock().host_state_bytes()
    }
}

impl<R: UpdateRule> BenchOptimizer for Arc<Mutex<GroupOptimizer<R>>> {
    fn handle(&self) -> Box<dyn Optimizer> {
        Box::new(SharedOptimizer(Arc::clone(self)))
    }

    fn state_bytes(&self) -> u64 {
        group_state_bytes(&self.lock())
    }
}

/// Bytes of every state tensor `optimizer` holds.
fn group_state_bytes<R: UpdateRule>(optimizer: &GroupOptimizer<R>) -> u64 {
    let mut bytes = 0;
    for (g, group) in optimizer.groups().iter().enumerate() {
        for idx in 0..group.params.len() {
            bytes += optimizer
                .param_state(g, idx)
                .iter()
                .map(|(_, tensor)| tensor_bytes(tensor))
                .sum::<u64>();
        }
    }
    bytes
}

/// An optimizer behind a lock, as an [`Optimizer`]: the bench keeps one handle to count its
/// state while the training loop (or an `InBackward`) steps through another.
struct SharedOptimizer<O: Optimizer>(Arc<Mutex<O>>);

impl<O: Optimizer> Optimizer for SharedOptimizer<O> {
    fn name(&self) -> &'static str {
        self.0.lock().name()
    }

    fn n_groups(&self) -> usize {
        self.0.lock().n_groups()
    }

    fn lr(&self, group: usize) -> f64 {
        self.0.lock().lr(group)
    }

    fn set_lr(&mut self, group: usize, lr: f64) {
        self.0.lock().set_lr(group, lr)
    }

    fn params(&self) -> Vec<(ParamId, Tensor)> {
        self.0.lock().params()
    }

    fn param_id(&self, param: &Tensor) -> Result<ParamId, OptimError> {
        self.0.lock().param_id(param)
    }

    fn step_with(
        &mut self,
        params: StepParams<'_>,
        scaling: Scaling<'_>,
    ) -> Result<StepOutcome, OptimError> {
        self.0.lock().step_with(params, scaling)
    }

    fn finish_steps(&mut self) -> Result<(), OptimError> {
        self.0.lock().finish_steps()
    }

    fn zero_grad(&self, set_to_none: bool) -> Result<(), OptimError> {
        self.0.lock().zero_grad(set_to_none)
    }

    fn state_dict(&self) -> Result<Vec<u8>, OptimError> {
        self.0.lock().state_dict()
    }

    fn load_state_dict(&mut self, bytes: &[u8]) -> Result<(), OptimError> {
        self.0.lock().load_state_dict(bytes)
    }
}
