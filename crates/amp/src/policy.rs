//! Which op runs in which dtype under autocast: PyTorch's CUDA lists as data, and the policy
//! that applies them through autograd-core's autocast seam.
//!
//! [`AutocastLists::torch_cuda`] is PyTorch's CUDA autocast registration by aten op name
//! (overload names dropped), transcribed from `aten/src/ATen/autocast_mode.h` (the `AT_FORALL_*`
//! lists) and `autocast_mode.cpp` (their CUDA registrations, plus the two cuDNN convolutions and
//! the banned `binary_cross_entropy`) for PyTorch 2.11; `testdata/autocast_dtypes.json` (PyTorch
//! 2.11 on an H200) holds the output dtypes a parity test checks for every op Headroom has.
//! Each Headroom op is decided by the aten op PyTorch runs for it ([`torch_op_of`]): `linear_gelu`
//! by `linear`, `patch_embedding` by `conv2d`, `cross_entropy` by `log_softmax` (the first op of
//! `cross_entropy_loss`, which no list names).
//!
//! [`AmpPolicy`] turns the lists into a [`CastPolicy`] per op: the lower-precision list casts to
//! the autocast dtype, the three f32 lists to f32, the promote list to the widest input. Ops on
//! no list keep their inputs, except the ones whose inputs PyTorch combines by its ordinary type
//! promotion (`add`, `sub`, `mul`, `div`, `cat`): Headroom's ops do not promote implicitly, so
//! amp asks for [`CastPolicy::Promote`], which gives them PyTorch's output dtype. Users override
//! the lists ([`AutocastLists`] is plain data) or single ops ([`AmpPolicy::with_override`]).
//!
//! The policy answers the same on every device: on the CPU backend it gives the dtypes the CUDA
//! run will have, which is what the CPU, Headroom's reference backend, is for. It knows nothing
//! about kernels, and the cast cache is autograd-core's.

use std::collections::HashMap;
use std::sync::Arc;

use headroom_autograd_core::{
    autocast, AutocastGuard, AutocastPolicy, CastPolicy, DType, Device, AUTOCAST_OPS,
};

use crate::error::AmpError;

/// PyTorch's autocast lists, by aten op name: which ops run in the lower-precision dtype, which in
/// f32, which in the widest input dtype. Plain data: edit it to change what autocast does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutocastLists {
    /// `lower_precision_fp`: inputs cast to the autocast dtype (f16 or bf16).
    pub lower_precision: Vec<&'static str>,
    /// `fp32`: inputs cast to f32.
    pub fp32: Vec<&'static str>,
    /// `fp32_set_opt_dtype`: run in f32 by passing `dtype=float32` (reductions, softmax).
    pub fp32_set_opt_dtype: Vec<&'static str>,
    /// `fp32_append_dtype`: run in f32 by redispatching with an f32 output dtype (`norm`).
    pub fp32_append_dtype: Vec<&'static str>,
    /// `promote`: inputs cast to the widest floating dtype among them.
    pub promote: Vec<&'static str>,
    /// Ops autocast refuses (PyTorch raises; Headroom has none of them).
    pub banned: Vec<&'static str>,
}

/// The list of [`AutocastLists`] an aten op is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TorchList {
    /// `lower_precision_fp`.
    LowerPrecision,
    /// `fp32`.
    Fp32,
    /// `fp32_set_opt_dtype`.
    Fp32SetOptDtype,
    /// `fp32_append_dtype`.
    Fp32AppendDtype,
    /// `promote`.
    Promote,
    /// Banned under autocast.
    Banned,
    /// On no list: the op runs on its inputs as they are.
    Unlisted,
}

impl AutocastLists {
    /// PyTorch 2.11's CUDA lists (`AT_FORALL_LOWER_PRECISION_FP`, `AT_FORALL_FP32`,
    /// `AT_FORALL_FP32_SET_OPT_DTYPE`, `AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`,
    /// `AT_FORALL_PROMOTE`, and the CUDA-only registrations of `autocast_mode.cpp`).
    pub fn torch_cuda() -> AutocastLists {
        AutocastLists {
            lower_precision: vec![
                "_convolution",
                "conv1d",
                "conv2d",
                "conv3d",
                "conv_tbc",
                "conv_transpose1d",
                "conv_transpose2d",
                "conv_transpose3d",
                "convolution",
                "prelu",
                "addmm",
                "addmv",
                "addr",
                "matmul",
                "einsum",
                "mm",
                "mv",
                "linalg_vecdot",
                "linear",
                "addbmm",
                "baddbmm",
                "bmm",
                "chain_matmul",
                "linalg_multi_dot",
                "_thnn_fused_lstm_cell",
                "_thnn_fused_gru_cell",
                "lstm_cell",
                "gru_cell",
                "rnn_tanh_cell",
                "rnn_relu_cell",
                "_scaled_dot_product_flash_attention",
                "scaled_dot_product_attention",
                "cudnn_convolution",
                "cudnn_convolution_transpose",
            ],
            fp32: vec![
                "acos",
                "asin",
                "cosh",
                "erfinv",
                "exp",
                "expm1",
                "log",
                "log10",
                "log2",
                "log1p",
                "reciprocal",
                "rsqrt",
                "sinh",
                "tan",
                "pow",
                "softplus",
                "layer_norm",
                "native_layer_norm",
                "group_norm",
                "frobenius_norm",
                "nuclear_norm",
                "cosine_similarity",
                "poisson_nll_loss",
                "cosine_embedding_loss",
                "nll_loss",
                "nll_loss2d",
                "hinge_embedding_loss",
                "kl_div",
                "l1_loss",
                "smooth_l1_loss",
                "huber_loss",
                "mse_loss",
                "margin_ranking_loss",
                "multilabel_margin_loss",
                "soft_margin_loss",
                "triplet_margin_loss",
                "multi_margin_loss",
                "binary_cross_entropy_with_logits",
                "dist",
                "pdist",
                "cdist",
                "renorm",
                "logsumexp",
                "upsample_nearest1d",
                "_upsample_nearest_exact1d",
                "upsample_nearest2d",
                "_upsample_nearest_exact2d",
                "upsample_nearest3d",
                "_upsample_nearest_exact3d",
                "upsample_linear1d",
                "upsample_bilinear2d",
                "_upsample_bilinear2d_aa",
                "upsample_trilinear3d",
                "upsample_bicubic2d",
                "_upsample_bicubic2d_aa",
            ],
            fp32_set_opt_dtype: vec![
                "prod",
                "softmax",
                "log_softmax",
                "cumprod",
                "cumsum",
                "linalg_vector_norm",
                "linalg_matrix_norm",
                "sum",
            ],
            fp32_append_dtype: vec!["norm"],
            promote: vec![
                "addcdiv",
                "addcmul",
                "atan2",
                "bilinear",
                "cross",
                "dot",
                "vdot",
                "grid_sampler",
                "index_put",
                "tensordot",
                "scatter_add",
            ],
            banned: vec!["binary_cross_entropy"],
        }
    }

    /// The list `aten_op` is on (the first that names it, in the order of [`TorchList`]).
    pub fn list_of(&self, aten_op: &str) -> TorchList {
        let lists = [
            (&self.lower_precision, TorchList::LowerPrecision),
            (&self.fp32, TorchList::Fp32),
            (&self.fp32_set_opt_dtype, TorchList::Fp32SetOptDtype),
            (&self.fp32_append_dtype, TorchList::Fp32AppendDtype),
            (&self.promote, TorchList::Promote),
            (&self.banned, TorchList::Banned),
        ];
        lists
            .into_iter()
            .find(|(ops, _)| ops.contains(&aten_op))
            .map_or(TorchList::Unlisted, |(_, list)| list)
    }
}

/// A Headroom op as PyTorch runs it: the aten op whose list decides its dtypes, and whether
/// PyTorch combines its floating inputs by ordinary type promotion when no list names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TorchOp {
    /// The aten op.
    pub aten: &'static str,
    /// Several floating inputs combined by PyTorch's type promotion (`a + b`, `torch.cat`).
    pub promotes_inputs: bool,
}

/// The aten op of each name in [`AUTOCAST_OPS`].
const TORCH_OPS: &[(&str, &str, bool)] = &[
    ("matmul", "matmul", false),
    ("linear", "linear", false),
    ("linear_gelu", "linear", false),
    (
        "scaled_dot_product_attention",
        "scaled_dot_product_attention",
        false,
    ),
    ("patch_embedding", "conv2d", false),
    ("softmax", "softmax", false),
    ("log_softmax", "log_softmax", false),
    ("layer_norm", "layer_norm", false),
    ("cross_entropy", "log_softmax", false),
    ("sum", "sum", false),
    ("mean", "mean", false),
    ("max", "max", false),
    ("exp", "exp", false),
    ("log", "log", false),
    ("sqrt", "sqrt", false),
    ("rsqrt", "rsqrt", false),
    ("tanh", "tanh", false),
    ("relu", "relu", false),
    ("gelu", "gelu", false),
    ("gelu_tanh", "gelu", false),
    ("pow", "pow", false),
    ("pow_scalar", "pow", false),
    ("add", "add", true),
    ("sub", "sub", true),
    ("mul", "mul", true),
    ("div", "div", true),
    ("cat", "cat", true),
    ("embedding", "embedding", false),
    ("masked_fill", "masked_fill", false),
    ("dropout", "dropout", false),
];

/// How PyTorch runs Headroom's op `op` (a name in [`AUTOCAST_OPS`]), or `None` for another name.
pub fn torch_op_of(op: &str) -> Option<TorchOp> {
    TORCH_OPS
        .iter()
        .find(|(name, _, _)| *name == op)
        .map(|&(_, aten, promotes_inputs)| TorchOp {
            aten,
            promotes_inputs,
        })
}

/// The cast policy `lists` give `op`.
fn policy_from_lists(lists: &AutocastLists, op: &str) -> CastPolicy {
    let Some(torch) = torch_op_of(op) else {
        return CastPolicy::Keep;
    };
    match lists.list_of(torch.aten) {
        TorchList::LowerPrecision => CastPolicy::LowerPrecision,
        TorchList::Fp32 | TorchList::Fp32SetOptDtype | TorchList::Fp32AppendDtype => {
            CastPolicy::Float32
        }
        TorchList::Promote => CastPolicy::Promote,
        TorchList::Banned | TorchList::Unlisted if torch.promotes_inputs => CastPolicy::Promote,
        TorchList::Banned | TorchList::Unlisted => CastPolicy::Keep,
    }
}

/// An autocast policy: the lower-precision dtype and a [`CastPolicy`] for every op in
/// [`AUTOCAST_OPS`], from [`AutocastLists`] with per-op overrides. Enter it with
/// [`AmpPolicy::enter`] (or autograd-core's `autocast`).
///
/// ```
/// use headroom_amp::AmpPolicy;
/// use headroom_autograd_core::{CastPolicy, DType, Tensor};
/// use headroom_ops_cpu::CpuBackend;
///
/// let cpu = CpuBackend::new_ref();
/// let policy = AmpPolicy::torch_cuda(DType::BF16)?;
/// assert_eq!(policy.cast_policy_of("linear"), CastPolicy::LowerPrecision);
/// assert_eq!(policy.cast_policy_of("softmax"), CastPolicy::Float32);
///
/// let x = Tensor::ones(&cpu, &[2, 4], DType::F32)?;
/// let w = Tensor::ones(&cpu, &[3, 4], DType::F32)?;
/// let y = {
///     let _autocast = policy.enter();
///     x.linear(&w, None)?.softmax(-1)?
/// };
/// assert_eq!(y.dtype(), DType::F32); // linear ran in bf16, softmax in f32
///
/// // Overrides: keep softmax in the input dtype.
/// let policy = policy.with_override("softmax", CastPolicy::Keep)?;
/// let _autocast = policy.enter();
/// assert_eq!(x.linear(&w, None)?.softmax(-1)?.dtype(), DType::BF16);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct AmpPolicy {
    dtype: DType,
    lists: AutocastLists,
    overrides: Vec<(&'static str, CastPolicy)>,
    policies: HashMap<&'static str, CastPolicy>,
}

impl AmpPolicy {
    /// PyTorch's CUDA autocast with `dtype` (F16, PyTorch's default on CUDA, or BF16).
    pub fn torch_cuda(dtype: DType) -> Result<AmpPolicy, AmpError> {
        AmpPolicy::new(dtype, AutocastLists::torch_cuda())
    }

    /// A policy from `lists` with `dtype` as the lower-precision dtype (F16 or BF16).
    pub fn new(dtype: DType, lists: AutocastLists) -> Result<AmpPolicy, AmpError> {
        if !matches!(dtype, DType::F16 | DType::BF16) {
            return Err(AmpError::NotHalf {
                what: "the autocast dtype",
                dtype,
            });
        }
        let mut res = AmpPolicy {
            dtype,
            lists,
            overrides: Vec::new(),
            policies: HashMap::new(),
        };
        res.rebuild();
        Ok(res)
    }

    /// This policy with `op` (a name in [`AUTOCAST_OPS`]) doing `policy` whatever the lists say.
    pub fn with_override(mut self, op: &str, policy: CastPolicy) -> Result<AmpPolicy, AmpError> {
        let op = AUTOCAST_OPS
            .iter()
            .copied()
            .find(|known| *known == op)
            .ok_or_else(|| AmpError::UnknownOp { op: op.to_string() })?;
        self.overrides.retain(|(name, _)| *name != op);
        self.overrides.push((op, policy));
        self.rebuild();
        Ok(self)
    }

    fn rebuild(&mut self) {
        self.policies = AUTOCAST_OPS
            .iter()
            .map(|&op| (op, policy_from_lists(&self.lists, op)))
            .collect();
        for &(op, policy) in &self.overrides {
            self.policies.insert(op, policy);
        }
    }

    /// The lower-precision dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The lists the policy was made from.
    pub fn lists(&self) -> &AutocastLists {
        &self.lists
    }

    /// What `op` does with its floating-point inputs (`Keep` for a name not in
    /// [`AUTOCAST_OPS`]).
    pub fn cast_policy_of(&self, op: &str) -> CastPolicy {
        self.policies.get(op).copied().unwrap_or(CastPolicy::Keep)
    }

    /// Runs ops under this policy on this thread until the guard drops (casts of parameters
    /// cached until the outermost scope ends).
    pub fn enter(&self) -> AutocastGuard {
        autocast(Arc::new(self.clone()))
    }
}

impl AutocastPolicy for AmpPolicy {
    fn lower_precision(&self) -> DType {
        self.dtype
    }

    fn cast_policy(&self, op: &'static str, _device: Device) -> CastPolicy {
        self.cast_policy_of(op)
    }
}
