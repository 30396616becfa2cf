//! Fused linear + cross-entropy: the loss of a language model's head,
//! `cross_entropy_f32(hidden @ weightᵀ + bias, labels)`, without ever holding its logits.
//!
//! The logits of a large vocabulary are the largest tensors of a step (8192 tokens × 128,256
//! classes are 2.1 GB in bf16, and their gradient as much again). This op computes them one
//! chunk of tokens at a time and keeps only each token's log-sum-exp:
//!
//! - **Forward**, per chunk of rows: the logits chunk (`Backend::linear`, in the inputs' dtype,
//!   as the unfused linear rounds them), then `Backend::cross_entropy` on it for the rows'
//!   log-sum-exp (f32, f64 for f64 inputs) and their summed loss; label smoothing, z-loss and
//!   `reduction: None` take the label logit (`gather`) and the row sum of the logits from the
//!   same chunk. The loss is f32 (f64 for f64 inputs).
//! - **Saved**: `hidden`, `weight`, `bias`, `labels` and the per-row log-sum-exp, nothing more.
//! - **Backward** recomputes each chunk's logits, turns them into their gradient in place
//!   (`g·(1 + 2·z_loss·lse)·softmax − g·(1 − ε)·onehot − g·ε/V`, with `g` the row's share of
//!   the loss gradient), and accumulates `dhidden = dlogits @ weight` and
//!   `dweight = dlogitsᵀ @ hidden` (`dbias` its column sums) chunk by chunk. In f32 and f64 one
//!   pass over token chunks does both (the weight gradient accumulates in its own dtype). In
//!   f16 and bf16 an accumulation across chunks would round the weight gradient once per chunk,
//!   so the backward takes two passes: token chunks (all classes) for `dhidden`, then class
//!   chunks (all tokens) for `dweight` and `dbias`, each gradient element written by one
//!   product over its full reduction with f32 accumulation, as the unfused products do.
//!
//! The chunk size comes from a byte budget ([`LinearCrossEntropyOptions::chunk_bytes`], 64 MiB
//! by default) that bounds everything the op allocates beyond its inputs, its gradients and two
//! f32 vectors of one value per token (the log-sum-exp and, in backward, each row's gradient
//! factor): so the peak stays within `chunk_bytes + 8 B per token` in every phase. What one
//! chunk holds at once, and the budget counts:
//!
//! - its logits in the inputs' dtype and, for f16 and bf16, their f32 copy (the forward's for
//!   label smoothing; the backward's to compute their gradient, which is rounded back into the
//!   logits' buffer before the copy is freed, so the products read the buffer the linear
//!   wrote): `Head::bytes_per_logit`;
//! - `ROW_BYTES` a row for the per-row vectors (label indices, the one-hot and smoothing
//!   terms, the ones row that sums the bias gradient by a product, a backend's per-row scratch);
//! - `SMALL_BLOCKS_BYTES` for the scalars and the 512-byte rounding of the allocator's
//!   blocks, and `LARGE_BLOCK_SLACK` (1 MiB) for each large buffer, which the allocator may
//!   hand out in a block up to 1 MiB larger than asked;
//! - the backend's matrix-product workspace ([`crate::Backend::matmul_workspace_bytes`]: on
//!   CUDA, cuBLAS's 32 MiB, taken from the caching allocator on the first product and kept,
//!   shared by every product, never one per call): the rule is that the chunks get
//!   `chunk_bytes − workspace`, so the bound holds even when this op runs the backend's first
//!   product.
//!
//! Labels are read to the host once per forward and once per backward (validated there: typed
//! errors, never an out-of-bounds read), and the per-row weights (ignored rows, the mean's
//! divisor) go back as small per-chunk vectors, so no per-token buffer besides the log-sum-exp
//! and the row factors outlives a chunk.
//!
//! It is an ordinary op for the rest of the kit: it records one node whose inputs are `hidden`,
//! `weight` and `bias`, so the weight's gradient reaches its hooks and accumulates with other
//! uses (a tied embedding); autocast casts its operands as it casts a `linear`'s; its saved
//! tensors go through the saved-tensor hooks. Built only from `Backend` primitives, it runs on
//! every backend. Nothing here knows how a backend computes.

use crate::autocast::{autocast_disabled, autocast_inputs};
use crate::backend::{CrossEntropyArgs, Reduction, UnaryOp};
use crate::dtype::{stats_dtype, DType};
use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::graph::record;
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::linalg::linear_operands;
use super::{check_dtype, check_float, check_same, records};

const OP: &str = "linear_cross_entropy";

/// Bytes a chunk may hold for each of its rows beyond its logits: the per-row vectors live at
/// once (an I64 label index, the one-hot and smoothing terms, the z-loss scale, the ones row of
/// the bias gradient: at most 6 values of 8 bytes in f64) and a backend's per-row scratch
/// (CUDA's cross-entropy keeps 16 bytes a row), rounded up.
const ROW_BYTES: usize = 64;

/// Bytes the budget keeps for small blocks: scalars (the loss, its chunk sums) and the rounding
/// of every block to 512 bytes by the caching allocator (a few blocks a chunk).
const SMALL_BLOCKS_BYTES: usize = 16 << 10;

/// Bytes the allocator may count beyond a large request: it hands a block out whole when
/// splitting it would leave at most 1 MiB (PyTorch's rule, and the caching allocator's), so
/// each of a chunk's large buffers (its logits, their f32 copy) may count up to 1 MiB more.
const LARGE_BLOCK_SLACK: usize = 1 << 20;

/// Options of [`linear_cross_entropy`]. [`Default`] gives PyTorch's defaults for
/// `F.cross_entropy` (`ignore_index=-100`, `reduction="mean"`, `label_smoothing=0`), no z-loss
/// and 64 MiB chunks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearCrossEntropyOptions {
    /// Tokens whose label is this contribute no loss and no gradient, and are not counted by
    /// the mean.
    pub ignore_index: i64,
    /// How the per-token losses combine: `Some(Mean)` over the tokens not ignored,
    /// `Some(Sum)`, or `None` for one loss per token (PyTorch's `reduction="none"`), shaped like
    /// `labels`, 0 at ignored tokens.
    pub reduction: Option<Reduction>,
    /// `ε` in `[0, 1]`: the target is `(1 − ε)·onehot + ε / classes`, as in PyTorch.
    pub label_smoothing: f64,
    /// The coefficient of PaLM's (and Liger's) auxiliary z-loss, `z_loss · lse²` added to each
    /// token's loss (`lse` the log-sum-exp of its logits); 0 adds nothing.
    pub z_loss: f64,
    /// The bound on what the op allocates beyond its inputs, its gradients and 8 bytes a token
    /// (the per-token log-sum-exp and gradient factor): one chunk's logits, their f32 copy for
    /// f16 and bf16, per-row vectors, small blocks, and the backend's matrix-product workspace
    /// ([`crate::Backend::matmul_workspace_bytes`], 32 MiB on CUDA). It sets how many tokens
    /// (and, for the f16/bf16 weight gradient, how many classes) one chunk holds; at least one
    /// row or class, so a budget below the fixed costs is exceeded by one row's.
    pub chunk_bytes: usize,
}

impl Default for LinearCrossEntropyOptions {
    fn default() -> Self {
        LinearCrossEntropyOptions {
            ignore_index: -100,
            reduction: Some(Reduction::Mean),
            label_smoothing: 0.0,
            z_loss: 0.0,
            chunk_bytes: 64 << 20,
        }
    }
}

/// The cross-entropy of the logits `hidden @ weightᵀ + bias` against `labels`, computed chunk by
/// chunk so that no more than one chunk of logits exists at a time (see the module docs).
///
/// `hidden` is `[.., in]` (f64, f32, f16 or bf16), `weight` `[classes, in]` and `bias`
/// `[classes]` of its dtype, `labels` I64 shaped like `hidden` without its last dim. The value
/// equals `cross_entropy_f32(&hidden.linear(weight, bias)?.reshape([rows, classes])?, ..)`
/// (`cross_entropy` for f64, which stays f64), extended by the options: the loss is f32 (f64
/// for f64 inputs), and the gradients of `hidden`, `weight` and `bias` are in their dtype.
///
/// ```
/// use headroom_autograd_core::{linear_cross_entropy, DType, LinearCrossEntropyOptions, Tensor};
///
/// let cpu = headroom_ops_cpu::CpuBackend::new_ref();
/// let hidden = Tensor::from_slice(&cpu, &[1.0f32, 0.0, 0.0, 1.0], &[2, 2])?;
/// let weight = Tensor::from_slice(&cpu, &[1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0], &[3, 2])?;
/// let labels = Tensor::from_slice(&cpu, &[0i64, -100], &[2])?;
/// let loss = linear_cross_entropy(&hidden, &weight, None, &labels, &LinearCrossEntropyOptions::default())?;
/// // Row 0's logits are [1, 0, 1]; row 1 is ignored.
/// let expected = (1f64.exp() * 2.0 + 1.0).ln() - 1.0;
/// assert!((loss.item()? - expected).abs() < 1e-6);
/// # Ok::<(), headroom_autograd_core::TensorError>(())
/// ```
pub fn linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    labels: &Tensor,
    options: &LinearCrossEntropyOptions,
) -> Result<Tensor> {
    // Autocast runs this op as it runs a linear: its operands in the low-precision dtype.
    if let Some(cast) = autocast_inputs("linear", &[Some(hidden), Some(weight), bias])? {
        let (hidden, weight, bias) = linear_operands(cast);
        return linear_cross_entropy(&hidden, &weight, bias.as_ref(), labels, options);
    }
    let _autocast = autocast_disabled();
    let head = Head::check(hidden, weight, bias, labels, options)?;
    let (hidden_2d, labels_1d) = {
        let _guard = no_grad();
        (
            hidden.contiguous()?.reshape(&[head.rows, head.features])?,
            labels.contiguous()?.reshape(&[head.rows])?,
        )
    };
    let host_labels = head.read_labels(&labels_1d)?;
    let (loss, lse) = {
        let _guard = no_grad();
        head.forward(&hidden_2d, weight, bias, &labels_1d, &host_labels)?
    };
    let loss = match head.options.reduction {
        Some(_) => loss,
        None => loss.into_shape(labels.shape()),
    };
    let mut inputs = vec![hidden, weight];
    inputs.extend(bias);
    if records(&inputs) {
        let saved_hidden = SavedTensor::save(OP, SaveRole::Input(0), &hidden_2d)?;
        let saved_weight = SavedTensor::save(OP, SaveRole::Input(1), weight)?;
        let saved_bias = match bias {
            Some(bias) => Some(SavedTensor::save(OP, SaveRole::Input(2), bias)?),
            None => None,
        };
        let saved_labels = SavedTensor::save(OP, SaveRole::Input(3), &labels_1d)?;
        let saved_lse = SavedTensor::save(OP, SaveRole::Intermediate("lse"), &lse)?;
        let wants = Wants {
            hidden: hidden.requires_grad(),
            weight: weight.requires_grad(),
            bias: bias.is_some_and(Tensor::requires_grad),
        };
        let hidden_shape = hidden.shape().to_vec();
        record(OP, &inputs, &[&loss], move |grads| {
            let dloss = grads[0].as_ref().expect("one output");
            let hidden_2d = saved_hidden.unpack()?;
            let weight = saved_weight.unpack()?;
            let bias = saved_bias.as_ref().map(SavedTensor::unpack).transpose()?;
            let host_labels = head.read_labels(&saved_labels.unpack()?)?;
            let operands = Operands {
                hidden: &hidden_2d,
                weight: &weight,
                bias: bias.as_ref(),
                lse: &saved_lse.unpack()?,
                labels: &host_labels,
            };
            let grads = head.backward(&operands, dloss, wants)?;
            let mut res = vec![
                grads.hidden.map(|dh| dh.into_shape(&hidden_shape)),
                grads.weight,
            ];
            if head.has_bias {
                res.push(grads.bias);
            }
            Ok(res)
        });
    }
    Ok(loss)
}

/// The checked geometry and options of one call.
#[derive(Debug, Clone, Copy)]
struct Head {
    rows: usize,
    features: usize,
    classes: usize,
    dtype: DType,
    has_bias: bool,
    options: LinearCrossEntropyOptions,
    /// The backend's matrix-product workspace, which the chunks leave to it.
    workspace: usize,
}

/// Which gradients backward computes.
#[derive(Debug, Clone, Copy)]
struct Wants {
    hidden: bool,
    weight: bool,
    bias: bool,
}

/// The gradients backward returns.
struct Grads {
    hidden: Option<Tensor>,
    weight: Option<Tensor>,
    bias: Option<Tensor>,
}

/// What backward reads: the saved tensors and the labels on the host.
struct Operands<'a> {
    hidden: &'a Tensor,
    weight: &'a Tensor,
    bias: Option<&'a Tensor>,
    lse: &'a Tensor,
    labels: &'a [i64],
}

/// A chunk of the logits: rows `rows.0..rows.0 + rows.1`, classes `classes.0..classes.0 +
/// classes.1` (start and length).
#[derive(Debug, Clone, Copy)]
struct Tile {
    rows: (usize, usize),
    classes: (usize, usize),
}

impl Head {
    fn check(
        hidden: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        labels: &Tensor,
        options: &LinearCrossEntropyOptions,
    ) -> Result<Head> {
        check_float(OP, hidden)?;
        check_same(OP, hidden, weight)?;
        check_dtype(OP, labels, DType::I64)?;
        super::check_device(OP, hidden, labels)?;
        let shape_error = |rhs: &Tensor| TensorError::ShapeMismatch {
            op: OP,
            lhs: hidden.shape().to_vec(),
            rhs: rhs.shape().to_vec(),
        };
        let Some((&features, leading)) = hidden.shape().split_last() else {
            return Err(shape_error(weight));
        };
        if weight.ndim() != 2 || weight.shape()[1] != features {
            return Err(shape_error(weight));
        }
        if labels.shape() != leading {
            return Err(shape_error(labels));
        }
        let classes = weight.shape()[0];
        if let Some(bias) = bias {
            check_same(OP, hidden, bias)?;
            if bias.shape() != [classes] {
                return Err(shape_error(bias));
            }
        }
        let invalid = |reason: String| Err(TensorError::InvalidArgument { op: OP, reason });
        if classes == 0 {
            return invalid("the weight has no rows: a loss needs at least one class".into());
        }
        if !(0.0..=1.0).contains(&options.label_smoothing) {
            return invalid(format!(
                "label_smoothing {} is outside [0, 1]",
                options.label_smoothing
            ));
        }
        if !options.z_loss.is_finite() || options.z_loss < 0.0 {
            return invalid(format!(
                "z_loss {} is not a finite non-negative coefficient",
                options.z_loss
            ));
        }
        if options.chunk_bytes == 0 {
            return invalid("chunk_bytes is 0: a chunk needs a budget".into());
        }
        Ok(Head {
            rows: leading.iter().product(),
            features,
            classes,
            dtype: hidden.dtype(),
            has_bias: bias.is_some(),
            options: *options,
            workspace: hidden.backend().matmul_workspace_bytes(),
        })
    }

    /// The dtype of the loss, the log-sum-exp and the logits' gradient before rounding.
    fn stats(&self) -> DType {
        stats_dtype(self.dtype)
    }

    /// Whether the per-chunk logits need a copy in the stats dtype (f16 and bf16 inputs).
    fn is_half(&self) -> bool {
        self.dtype != self.stats()
    }

    /// The bytes one logit costs a chunk: the stats dtype, plus the inputs' dtype for f16/bf16.
    fn bytes_per_logit(&self) -> usize {
        let copy = if self.is_half() {
            self.dtype.size_in_bytes()
        } else {
            0
        };
        self.stats().size_in_bytes() + copy
    }

    /// The bytes the chunks' logits and per-row vectors may take: `chunk_bytes` less the
    /// backend's workspace, the small blocks and the large blocks' slack.
    fn chunk_budget(&self) -> usize {
        let large_buffers = if self.is_half() { 2 } else { 1 };
        let fixed = self.workspace + SMALL_BLOCKS_BYTES + large_buffers * LARGE_BLOCK_SLACK;
        self.options.chunk_bytes.saturating_sub(fixed)
    }

    /// Rows per chunk of a pass over all classes.
    fn rows_per_chunk(&self) -> usize {
        let per_row = self.classes * self.bytes_per_logit() + ROW_BYTES;
        (self.chunk_budget() / per_row).max(1)
    }

    /// Classes per chunk of a pass over all rows.
    fn classes_per_chunk(&self) -> usize {
        let budget = self.chunk_budget().saturating_sub(self.rows * ROW_BYTES);
        (budget / (self.rows * self.bytes_per_logit()).max(1)).max(1)
    }

    /// The chunks of a pass over all classes.
    fn row_tiles(&self) -> impl Iterator<Item = Tile> + '_ {
        let step = self.rows_per_chunk();
        (0..self.rows).step_by(step).map(move |start| Tile {
            rows: (start, step.min(self.rows - start)),
            classes: (0, self.classes),
        })
    }

    /// The chunks of a pass over all rows.
    fn class_tiles(&self) -> impl Iterator<Item = Tile> + '_ {
        let step = self.classes_per_chunk();
        (0..self.classes).step_by(step).map(move |start| Tile {
            rows: (0, self.rows),
            classes: (start, step.min(self.classes - start)),
        })
    }

    /// The labels on the host, each a class or `ignore_index`.
    fn read_labels(&self, labels: &Tensor) -> Result<Vec<i64>> {
        let labels = labels.to_vec::<i64>()?;
        let ignore = self.options.ignore_index;
        let classes = self.classes;
        match labels
            .iter()
            .find(|&&label| label != ignore && (label < 0 || label as usize >= classes))
        {
            Some(bad) => Err(TensorError::InvalidArgument {
                op: OP,
                reason: format!("label {bad} is out of bounds for {classes} classes"),
            }),
            None => Ok(labels),
        }
    }

    /// Each row's share of the reduced loss: 0 for ignored rows, else 1 (1 / count for the
    /// mean).
    fn row_weights(&self, labels: &[i64]) -> Vec<f64> {
        let ignore = self.options.ignore_index;
        let count = labels.iter().filter(|&&label| label != ignore).count();
        let share = match self.options.reduction {
            Some(Reduction::Mean) => 1.0 / count as f64,
            Some(Reduction::Sum) | None => 1.0,
        };
        labels
            .iter()
            .map(|&label| if label == ignore { 0.0 } else { share })
            .collect()
    }

    /// `values` as a stats-dtype vector on `like`'s backend.
    fn upload(&self, like: &Tensor, values: &[f64]) -> Result<Tensor> {
        Tensor::from_f64s(like.backend(), values, &[values.len()], self.stats())
    }

    /// The logits of `tile`, in the inputs' dtype.
    fn logits(
        &self,
        tile: Tile,
        hidden: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let hidden = hidden.narrow(0, tile.rows.0, tile.rows.1)?;
        let weight = weight.narrow(0, tile.classes.0, tile.classes.1)?;
        let bias = bias
            .map(|bias| bias.narrow(0, tile.classes.0, tile.classes.1))
            .transpose()?;
        hidden.linear(&weight, bias.as_ref())
    }

    /// The loss (reduced, or one per row) and each row's log-sum-exp.
    fn forward(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        labels: &Tensor,
        host_labels: &[i64],
    ) -> Result<(Tensor, Tensor)> {
        let stats = self.stats();
        let lse = hidden.new_empty(&[self.rows], stats)?;
        let total = hidden.new_zeros(&[], stats)?;
        let per_row = match self.options.reduction {
            Some(_) => None,
            None => Some(hidden.new_empty(&[self.rows], stats)?),
        };
        let plain =
            per_row.is_none() && self.options.label_smoothing == 0.0 && self.options.z_loss == 0.0;
        let ignore = self.options.ignore_index;
        for tile in self.row_tiles() {
            let (start, len) = tile.rows;
            let logits = self.logits(tile, hidden, weight, bias)?;
            let lse_rows = lse.narrow(0, start, len)?;
            let ce_sum = hidden.new_empty(&[], stats)?;
            let rows_target = labels.narrow(0, start, len)?;
            let args = CrossEntropyArgs {
                logits: logits.view(),
                target: rows_target.view(),
                ignore_index: ignore,
                reduction: Reduction::Sum,
            };
            hidden
                .backend()
                .cross_entropy(args, ce_sum.view(), lse_rows.view())?;
            if plain {
                total.add_(&ce_sum)?;
                continue;
            }
            let rows_labels = &host_labels[start..start + len];
            let row_loss = self.row_losses(&logits, &lse_rows, rows_labels)?;
            match &per_row {
                Some(per_row) => {
                    per_row.narrow(0, start, len)?.copy_(&row_loss)?;
                }
                None => {
                    total.add_(&row_loss.sum_all()?)?;
                }
            }
        }
        let loss = match (self.options.reduction, per_row) {
            (Some(Reduction::Mean), _) => {
                let count = host_labels.iter().filter(|&&label| label != ignore).count();
                total.mul_scalar(1.0 / count as f64)?
            }
            (_, Some(per_row)) => per_row,
            (_, None) => total,
        };
        Ok((loss, lse))
    }

    /// Each row's loss in the stats dtype, 0 for ignored rows:
    /// `lse − (1 − ε)·z[label] − (ε / classes)·Σ z + z_loss·lse²`.
    fn row_losses(&self, logits: &Tensor, lse: &Tensor, labels: &[i64]) -> Result<Tensor> {
        let (smoothing, z_loss) = (self.options.label_smoothing, self.options.z_loss);
        let ignore = self.options.ignore_index;
        let index: Vec<i64> = labels
            .iter()
            .map(|&label| if label == ignore { 0 } else { label })
            .collect();
        let index = Tensor::from_slice(logits.backend(), &index, &[labels.len(), 1])?;
        let label_logit = logits
            .gather(1, &index)?
            .reshape(&[labels.len()])?
            .to_dtype(self.stats())?;
        let res = lse.sub(&label_logit.mul_scalar(1.0 - smoothing)?)?;
        if smoothing != 0.0 {
            let row_sum = logits.to_dtype(self.stats())?.sum(&[1], false)?;
            res.sub_(&row_sum.mul_scalar(smoothing / self.classes as f64)?)?;
        }
        if z_loss != 0.0 {
            res.add_(&lse.mul(lse)?.mul_scalar(z_loss)?)?;
        }
        let valid: Vec<f64> = labels
            .iter()
            .map(|&label| f64::from(u8::from(label != ignore)))
            .collect();
        res.mul_(&self.upload(lse, &valid)?)?;
        Ok(res)
    }

    /// The gradients of `hidden`, `weight` and `bias` from the loss's gradient `dloss`.
    fn backward(&self, operands: &Operands<'_>, dloss: &Tensor, wants: Wants) -> Result<Grads> {
        let _guard = no_grad();
        let zeros = |wanted: bool, tensor: &Tensor| -> Result<Option<Tensor>> {
            wanted
                .then(|| tensor.new_zeros(tensor.shape(), tensor.dtype()))
                .transpose()
        };
        let grads = Grads {
            hidden: zeros(wants.hidden, operands.hidden)?,
            weight: zeros(wants.weight, operands.weight)?,
            bias: match operands.bias {
                Some(bias) => zeros(wants.bias, bias)?,
                None => None,
            },
        };
        // Each row's gradient factor: dloss (per row, or the scalar spread) times its weight.
        let dloss_rows = match self.options.reduction {
            Some(_) => dloss.reshape(&[1])?.expand(&[self.rows])?,
            None => dloss.contiguous()?.reshape(&[self.rows])?,
        };
        // In place, so one per-token vector besides the log-sum-exp is live.
        let row_factor = self.upload(dloss, &self.row_weights(operands.labels))?;
        row_factor.mul_(&dloss_rows)?;
        let split = self.is_half() && (grads.weight.is_some() || grads.bias.is_some());
        if split {
            if let Some(dhidden) = &grads.hidden {
                for tile in self.row_tiles() {
                    self.tile_backward(tile, operands, &row_factor, [Some(dhidden), None, None])?;
                }
            }
            for tile in self.class_tiles() {
                let outputs = [None, grads.weight.as_ref(), grads.bias.as_ref()];
                self.tile_backward(tile, operands, &row_factor, outputs)?;
            }
        } else if wants.hidden || grads.weight.is_some() || grads.bias.is_some() {
            let outputs = [
                grads.hidden.as_ref(),
                grads.weight.as_ref(),
                grads.bias.as_ref(),
            ];
            for tile in self.row_tiles() {
                self.tile_backward(tile, operands, &row_factor, outputs)?;
            }
        }
        Ok(grads)
    }

    /// Recomputes `tile`'s logits, turns them into their gradient, and adds its products to
    /// `outputs` (the gradients of hidden, weight and bias, those wanted).
    fn tile_backward(
        &self,
        tile: Tile,
        operands: &Operands<'_>,
        row_factor: &Tensor,
        outputs: [Option<&Tensor>; 3],
    ) -> Result<()> {
        let (row_start, n_rows) = tile.rows;
        let (class_start, n_classes) = tile.classes;
        let backend = operands.hidden.backend();
        let dlogits = self.logits(tile, operands.hidden, operands.weight, operands.bias)?;
        self.logits_to_gradient(tile, operands, row_factor, &dlogits)?;
        let [dhidden, dweight, dbias] = outputs;
        if let Some(dhidden) = dhidden {
            let weight = operands.weight.narrow(0, class_start, n_classes)?;
            let rows = dhidden.narrow(0, row_start, n_rows)?;
            backend.matmul(dlogits.view(), weight.view(), rows.view(), true)?;
        }
        if let Some(dweight) = dweight {
            let hidden = operands.hidden.narrow(0, row_start, n_rows)?;
            let rows = dweight.narrow(0, class_start, n_classes)?;
            backend.matmul(dlogits.t()?.view(), hidden.view(), rows.view(), true)?;
        }
        if let Some(dbias) = dbias {
            // The column sums as a product with a row of ones: f32 accumulation like the other
            // products, no scratch of the size of the classes beyond a row per token.
            let ones = Tensor::ones(backend, &[1, n_rows], self.dtype)?;
            let columns = dbias.narrow(0, class_start, n_classes)?.unsqueeze(0)?;
            backend.matmul(ones.view(), dlogits.view(), columns.view(), true)?;
        }
        Ok(())
    }

    /// Overwrites `tile`'s logits with their gradient,
    /// `softmax · factor · (1 + 2 z_loss lse) − factor · ε / classes − factor · (1 − ε) onehot`,
    /// computed in the stats dtype: in f16 and bf16 through an f32 copy, rounded back into
    /// `logits` and freed on return, with every per-row vector, before the products run.
    fn logits_to_gradient(
        &self,
        tile: Tile,
        operands: &Operands<'_>,
        row_factor: &Tensor,
        logits: &Tensor,
    ) -> Result<()> {
        let (row_start, n_rows) = tile.rows;
        let (class_start, n_classes) = tile.classes;
        let smoothing = self.options.label_smoothing;
        let backend = logits.backend();
        let factor = row_factor.narrow(0, row_start, n_rows)?;
        let lse = operands.lse.narrow(0, row_start, n_rows)?;
        let dlogits = if self.is_half() {
            logits.to_dtype(self.stats())?
        } else {
            logits.clone()
        };
        dlogits.sub_(&lse.unsqueeze(1)?)?;
        backend.unary(UnaryOp::Exp, dlogits.view(), dlogits.view())?;
        if self.options.z_loss == 0.0 {
            dlogits.mul_(&factor.unsqueeze(1)?)?;
        } else {
            let scale = lse.mul_scalar(2.0 * self.options.z_loss)?.add_scalar(1.0)?;
            dlogits.mul_(&factor.mul(&scale)?.unsqueeze(1)?)?;
        }
        if smoothing != 0.0 {
            dlogits.sub_(
                &factor
                    .mul_scalar(smoothing / self.classes as f64)?
                    .unsqueeze(1)?,
            )?;
        }
        let labels = &operands.labels[row_start..row_start + n_rows];
        let in_tile = |label: i64| {
            label != self.options.ignore_index
                && (class_start..class_start + n_classes).contains(&(label as usize))
        };
        let index: Vec<i64> = labels
            .iter()
            .map(|&label| {
                if in_tile(label) {
                    label - class_start as i64
                } else {
                    0
                }
            })
            .collect();
        let hit: Vec<f64> = labels
            .iter()
            .map(|&label| if in_tile(label) { smoothing - 1.0 } else { 0.0 })
            .collect();
        let index = Tensor::from_slice(backend, &index, &[n_rows, 1])?;
        let onehot = self.upload(&factor, &hit)?;
        onehot.mul_(&factor)?;
        let onehot = onehot.reshape(&[n_rows, 1])?;
        backend.scatter_add(dlogits.view(), 1, index.view(), onehot.view())?;
        if self.is_half() {
            logits.copy_(&dlogits)?;
        }
        Ok(())
    }
}
