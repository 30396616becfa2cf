//! Fused linear + cross-entropy: the loss of a language model's head,
//! `cross_entropy_f32(hidden @ weightᵀ + bias, labels)`, without ever holding its logits.
//!
//! The logits of a large vocabulary are the largest tensors of a step (8192 tokens × 128,256
//! classes are 2.1 GB in bf16, and their gradient as much again). This op computes them one
//! tile at a time — a block of rows by a range of classes, large enough on both sides that each
//! tile's products run at the matrix units' speed — and keeps only each token's log-sum-exp:
//!
//! - **Forward**, per block of rows, per tile of classes: the tile's logits (`Backend::linear`,
//!   in the inputs' dtype, as the unfused linear rounds them), folded by
//!   `Backend::cross_entropy_tile` into each row's running maximum and sum of exponentials (f32;
//!   f64 for f64 inputs), with the label's logit and, for label smoothing, the row's logit sum.
//!   After the block's last tile its rows' losses are
//!   `lse − (1 − ε)·z[label] − (ε / classes)·Σ z + z_loss·lse²`, 0 for ignored rows.
//! - **Saved**: `hidden`, `weight`, `bias`, `labels` and the per-row log-sum-exp, nothing more.
//! - **Backward**, per block of rows, per tile of classes: the tile's logits recomputed,
//!   overwritten in place by their gradient (`Backend::cross_entropy_tile_backward`:
//!   `g·(1 + 2·z_loss·lse)·softmax − g·(1 − ε)·onehot − g·ε/V`, `g` the row's share of the
//!   loss's gradient, rounded once into the inputs' dtype as the unfused gradient is), then
//!   three products: `dhidden[rows] += dlogits @ weight[classes]`,
//!   `dweight[classes] += dlogitsᵀ @ hidden[rows]` and `dbias[classes] += Σ_rows dlogits`.
//!   Four products in all (forward, recompute, two gradients), as the unfused op's three plus
//!   the recompute. For f16 and bf16, `dhidden` of the block accumulates across the class tiles
//!   in an f32 buffer (`Backend::matmul` into f32: no rounding until the block is done, so each
//!   element is rounded once, as the unfused product's); `dweight` accumulates across the row
//!   blocks in its own dtype, rounded once per block (`⌈rows / block⌉` times: 5 at the
//!   Llama-3.2-1B head's 8192 tokens and default budget), `dbias` in f32.
//!
//! The tile sizes come from a byte budget ([`LinearCrossEntropyOptions::chunk_bytes`], 64 MiB by
//! default) that bounds everything the op allocates beyond its inputs, its gradients and two
//! f32 vectors of one value per token (the log-sum-exp and each row's loss weight, which
//! backward turns into its gradient factor): so the peak stays within `chunk_bytes + 8 B per
//! token` in every phase. What the budget counts:
//!
//! - a tile's logits in the inputs' dtype, and in backward (f16 and bf16) the block's f32
//!   `dhidden` accumulator: half the budget goes to the accumulator and the block's per-row
//!   vectors, the rest to the tile, whose rows are the block's;
//! - `ROW_BYTES` a row for the block's per-row vectors (running statistics, label logits, the
//!   z-loss scale, the ones row that sums the bias gradient by a product);
//! - for f16/bf16 with a bias, the f32 accumulator of its gradient (4 bytes a class);
//! - `SMALL_BLOCKS_BYTES` for the scalars and the 512-byte rounding of the allocator's
//!   blocks, and `LARGE_BLOCK_SLACK` (1 MiB) for each large buffer, which the allocator may
//!   hand out in a block up to 1 MiB larger than asked;
//! - the matrix-product workspace the backend may still take
//!   ([`crate::Backend::matmul_workspace_bytes`]: on CUDA, cuBLAS's 32 MiB, taken from the
//!   caching allocator by the backend's first product and kept, shared by every product; 0
//!   once taken): the tiles get `chunk_bytes − workspace`, so the bound holds even when this op
//!   runs the backend's first product (the backward keeps the forward's answer: a workspace the
//!   forward took counts against the op's bound).
//!
//! Labels are read to the host once, in the forward (validated there: typed errors, never an
//! out-of-bounds read); backward takes the rows' weights from that copy. The tiles read the
//! labels on the device.
//!
//! It is an ordinary op for the rest of the kit: it records one node whose inputs are `hidden`,
//! `weight` and `bias`, so the weight's gradient reaches its hooks and accumulates with other
//! uses (a tied embedding); autocast casts its operands as it casts a `linear`'s; its saved
//! tensors go through the saved-tensor hooks. Built only from `Backend` primitives, it runs on
//! every backend. Nothing here knows how a backend computes.

use crate::autocast::{autocast_disabled, autocast_inputs};
use crate::backend::{CrossEntropyTile, CrossEntropyTileBackward, LogitTile, Reduction};
use crate::dtype::{stats_dtype, DType};
use crate::error::{Result, TensorError};
use crate::grad_mode::no_grad;
use crate::graph::record;
use crate::saved::{SaveRole, SavedTensor};
use crate::tensor::Tensor;

use super::linalg::linear_operands;
use super::{check_dtype, check_float, check_same, records};

const OP: &str = "linear_cross_entropy";

/// Bytes a block may hold for each of its rows beyond its tiles and accumulator: the per-row
/// vectors live at once (the running maximum and sum, the label logit, the logit sum, the row
/// loss and its weight, the z-loss scale, the ones row of the bias gradient: at most 8 values of
/// 8 bytes in f64), rounded up.
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
    /// (the per-token log-sum-exp and loss weight): one tile of logits, in backward for f16
    /// and bf16 a block's f32 `dhidden` accumulator (and the bias gradient's), per-row vectors,
    /// small blocks, and the matrix-product workspace the backend may still take
    /// ([`crate::Backend::matmul_workspace_bytes`], 32 MiB on CUDA until its first product). It sets how many tokens a
    /// block and how many classes a tile hold; at least one row and 256 classes (or all), so a
    /// budget below the fixed costs is exceeded by one row of 256 logits.
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
            let operands = Operands {
                hidden: &hidden_2d,
                weight: &weight,
                bias: bias.as_ref(),
                lse: &saved_lse.unpack()?,
                labels: &saved_labels.unpack()?,
                host_labels: &host_labels,
            };
            // The forward's room for the workspace stays: when the forward's products took it,
            // it was allocated within this op and counts against its bound.
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
    /// The matrix-product workspace the backend may still take, which the tiles leave to it.
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
    labels: &'a Tensor,
    host_labels: &'a [i64],
}

/// How the logits are cut: blocks of `rows` rows, tiles of `classes` classes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tiling {
    rows: usize,
    classes: usize,
}

/// The piece size that cuts `total` into as few pieces as a size of at most `most` allows, all of
/// nearly the same size, a multiple of 64 (when `most` is at least 64): no block or tile is
/// left with a remainder too small for the matrix units to run at speed.
fn balanced(total: usize, most: usize) -> usize {
    let most = most.max(1);
    if total <= most {
        return total.max(1);
    }
    // Sizes stay multiples of 64: a tile's width is its logits' row stride, and products whose
    // strides are not multiples of 16 bytes leave cuBLAS's fast kernels (measured on the H200:
    // 7126-class tiles ran at a sixth of the speed of 7168-class ones).
    let even = total.div_ceil(total.div_ceil(most));
    let rounded = even.div_ceil(64) * 64;
    if rounded <= most {
        rounded
    } else {
        aligned(most)
    }
}

/// Rounds `n` down to a multiple of 64 when it is at least 64 (products of such sizes run on
/// the matrix units' fast paths).
fn aligned(n: usize) -> usize {
    if n >= 64 {
        n / 64 * 64
    } else {
        n.max(1)
    }
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

    /// The dtype of the loss, the log-sum-exp, the per-row statistics and, for f16 and bf16,
    /// the accumulators.
    fn stats(&self) -> DType {
        stats_dtype(self.dtype)
    }

    /// Whether the inputs are f16 or bf16 (accumulated in f32 buffers).
    fn is_half(&self) -> bool {
        self.dtype != self.stats()
    }

    /// The tiling under the budget: `chunk_bytes` less the workspace, the small blocks, the
    /// large blocks' slack and (f16/bf16 with a bias gradient) the bias accumulator; half of it
    /// to the block's `dhidden` accumulator (`accumulator_row` bytes a row: f32 `features` in
    /// an f16/bf16 backward that wants `dhidden`, else 0) and per-row vectors, the rest to a
    /// tile of logits. Blocks hold as many rows as that half allows (all of them when nothing
    /// is accumulated and tiles of 256 classes fit), tiles as many classes as the rest allows
    /// (at least 256 or all classes, at least one row), both cut evenly ([`balanced`]).
    fn tiling(&self, accumulator_row: usize, bias_accumulator: bool) -> Tiling {
        let bias = if bias_accumulator {
            4 * self.classes
        } else {
            0
        };
        let fixed = self.workspace + SMALL_BLOCKS_BYTES + 2 * LARGE_BLOCK_SLACK + bias;
        let budget = self.options.chunk_bytes.saturating_sub(fixed);
        let per_logit = self.dtype.size_in_bytes();
        let min_classes = self.classes.min(256);
        let by_accumulator = budget / 2 / (accumulator_row + ROW_BYTES);
        let by_tile = budget / 2 / (min_classes * per_logit);
        let rows = balanced(self.rows, aligned(by_accumulator.min(by_tile)));
        let left = budget.saturating_sub(rows * (accumulator_row + ROW_BYTES));
        // At least 256 classes (all of them if fewer): a budget below the fixed costs is
        // exceeded by one row of 256 logits rather than cut into tiles of a few classes.
        let most_classes = aligned(left / (rows * per_logit)).max(min_classes);
        let classes = balanced(self.classes, most_classes);
        Tiling { rows, classes }
    }

    /// The forward's tiling: nothing accumulated besides the per-row statistics.
    fn forward_tiling(&self) -> Tiling {
        self.tiling(0, false)
    }

    /// The backward's tiling for the gradients `wants` asks for.
    fn backward_tiling(&self, wants: Wants) -> Tiling {
        let accumulator_row = if self.is_half() && wants.hidden {
            4 * self.features
        } else {
            0
        };
        self.tiling(accumulator_row, self.is_half() && wants.bias)
    }

    /// The blocks of rows `(start, len)` of `tiling`.
    fn row_blocks(&self, tiling: Tiling) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.rows)
            .step_by(tiling.rows)
            .map(move |start| (start, tiling.rows.min(self.rows - start)))
    }

    /// The tiles of classes `(start, len)` of `tiling`.
    fn class_tiles(&self, tiling: Tiling) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.classes)
            .step_by(tiling.classes)
            .map(move |start| (start, tiling.classes.min(self.classes - start)))
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

    /// Each row's weight in the loss: 0 for ignored rows, else 1.
    fn counted(&self, labels: &[i64]) -> Vec<f64> {
        let ignore = self.options.ignore_index;
        labels
            .iter()
            .map(|&label| f64::from(u8::from(label != ignore)))
            .collect()
    }

    /// Each row's share of the reduced loss: 0 for ignored rows, else 1 (1 / count for the
    /// mean).
    fn row_weights(&self, labels: &[i64]) -> Vec<f64> {
        let counted = self.counted(labels);
        let share = match self.options.reduction {
            Some(Reduction::Mean) => 1.0 / counted.iter().sum::<f64>(),
            Some(Reduction::Sum) | None => 1.0,
        };
        counted.iter().map(|weight| weight * share).collect()
    }

    /// `values` as a stats-dtype vector on `like`'s backend.
    fn upload(&self, like: &Tensor, values: &[f64]) -> Result<Tensor> {
        Tensor::from_f64s(like.backend(), values, &[values.len()], self.stats())
    }

    /// The logits of rows `rows` and classes `classes` (start, length), in the inputs' dtype.
    fn logits(
        &self,
        (rows, classes): ((usize, usize), (usize, usize)),
        hidden: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let hidden = hidden.narrow(0, rows.0, rows.1)?;
        let weight = weight.narrow(0, classes.0, classes.1)?;
        let bias = bias
            .map(|bias| bias.narrow(0, classes.0, classes.1))
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
        let counted_rows = self.counted(host_labels);
        let counted = self.upload(hidden, &counted_rows)?;
        let total = hidden.new_zeros(&[], stats)?;
        let per_row = match self.options.reduction {
            Some(_) => None,
            None => Some(hidden.new_empty(&[self.rows], stats)?),
        };
        let smoothing = self.options.label_smoothing;
        let tiling = self.forward_tiling();
        for (start, len) in self.row_blocks(tiling) {
            let row_max = Tensor::full(hidden.backend(), &[len], f64::NEG_INFINITY, stats)?;
            let row_sum = hidden.new_zeros(&[len], stats)?;
            let label_logit = hidden.new_zeros(&[len], stats)?;
            let logit_sum = (smoothing != 0.0)
                .then(|| hidden.new_zeros(&[len], stats))
                .transpose()?;
            let target = labels.narrow(0, start, len)?;
            for classes in self.class_tiles(tiling) {
                let logits = self.logits(((start, len), classes), hidden, weight, bias)?;
                hidden.backend().cross_entropy_tile(CrossEntropyTile {
                    tile: LogitTile {
                        logits: logits.view(),
                        class_start: classes.0,
                        target: target.view(),
                        ignore_index: self.options.ignore_index,
                    },
                    row_max: row_max.view(),
                    row_sum: row_sum.view(),
                    target_logit: label_logit.view(),
                    logit_sum: logit_sum.as_ref().map(Tensor::view),
                })?;
            }
            // lse = max + ln Σ exp(x − max); the rows' losses from it.
            let block_lse = lse.narrow(0, start, len)?;
            block_lse.copy_(&row_sum.log()?.add(&row_max)?)?;
            let row_loss = block_lse.sub(&label_logit.mul_scalar(1.0 - smoothing)?)?;
            if let Some(logit_sum) = &logit_sum {
                row_loss.sub_(&logit_sum.mul_scalar(smoothing / self.classes as f64)?)?;
            }
            if self.options.z_loss != 0.0 {
                row_loss.add_(&block_lse.mul(&block_lse)?.mul_scalar(self.options.z_loss)?)?;
            }
            row_loss.mul_(&counted.narrow(0, start, len)?)?;
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
                let count = counted_rows.iter().sum::<f64>();
                total.mul_scalar(1.0 / count)?
            }
            (_, Some(per_row)) => per_row,
            (_, None) => total,
        };
        Ok((loss, lse))
    }

    /// The gradients of `hidden`, `weight` and `bias` from the loss's gradient `dloss`.
    fn backward(&self, operands: &Operands<'_>, dloss: &Tensor, wants: Wants) -> Result<Grads> {
        let _guard = no_grad();
        let hidden = operands.hidden;
        let bias_wanted = wants.bias && operands.bias.is_some();
        let grads = Grads {
            hidden: wants
                .hidden
                .then(|| hidden.new_empty(hidden.shape(), self.dtype))
                .transpose()?,
            weight: wants
                .weight
                .then(|| {
                    operands
                        .weight
                        .new_empty(operands.weight.shape(), self.dtype)
                })
                .transpose()?,
            bias: bias_wanted
                .then(|| hidden.new_zeros(&[self.classes], self.dtype))
                .transpose()?,
        };
        if !(wants.hidden || wants.weight || bias_wanted) {
            return Ok(grads);
        }
        // Each row's gradient factor: dloss (per row, or the scalar spread) times its weight,
        // in place, so one per-token vector besides the log-sum-exp is live.
        let dloss_rows = match self.options.reduction {
            Some(_) => dloss.reshape(&[1])?.expand(&[self.rows])?,
            None => dloss.contiguous()?.reshape(&[self.rows])?,
        };
        let row_factor = self.upload(dloss, &self.row_weights(operands.host_labels))?;
        row_factor.mul_(&dloss_rows)?;
        let half = self.is_half();
        // f16/bf16 bias gradients accumulate in f32 and are rounded once at the end.
        let bias_accumulator = (half && bias_wanted)
            .then(|| hidden.new_zeros(&[self.classes], self.stats()))
            .transpose()?;
        let tiling = self.backward_tiling(Wants {
            bias: bias_wanted,
            ..wants
        });
        for (block, rows) in self.row_blocks(tiling).enumerate() {
            let block = Block {
                index: block,
                rows,
                factor: row_factor.narrow(0, rows.0, rows.1)?,
            };
            let accumulator = match &grads.hidden {
                Some(_) if half => Some(hidden.new_empty(&[rows.1, self.features], self.stats())?),
                Some(dhidden) => Some(dhidden.narrow(0, rows.0, rows.1)?),
                None => None,
            };
            let outputs = [
                accumulator.as_ref(),
                grads.weight.as_ref(),
                bias_accumulator.as_ref().or(grads.bias.as_ref()),
            ];
            self.block_backward(tiling, &block, operands, outputs)?;
            if let (true, Some(dhidden), Some(accumulator)) = (half, &grads.hidden, &accumulator) {
                dhidden.narrow(0, rows.0, rows.1)?.copy_(accumulator)?;
            }
        }
        if let (Some(dbias), Some(accumulator)) = (&grads.bias, &bias_accumulator) {
            dbias.copy_(accumulator)?;
        }
        Ok(grads)
    }

    /// One block of rows through every class tile: each tile's logits recomputed and turned
    /// into their gradient, then its products added to `outputs` (the block's `dhidden` rows or
    /// their f32 accumulator, the whole `dweight`, the whole `dbias` or its accumulator).
    fn block_backward(
        &self,
        tiling: Tiling,
        block: &Block,
        operands: &Operands<'_>,
        outputs: [Option<&Tensor>; 3],
    ) -> Result<()> {
        let (row_start, n_rows) = block.rows;
        let backend = operands.hidden.backend();
        let hidden = operands.hidden.narrow(0, row_start, n_rows)?;
        let lse = operands.lse.narrow(0, row_start, n_rows)?;
        let z_loss = self.options.z_loss;
        let scale = if z_loss == 0.0 {
            block.factor.clone()
        } else {
            let lse_term = lse.mul_scalar(2.0 * z_loss)?.add_scalar(1.0)?;
            block.factor.mul(&lse_term)?
        };
        let target = operands.labels.narrow(0, row_start, n_rows)?;
        let [dhidden, dweight, dbias] = outputs;
        let ones = dbias
            .map(|_| Tensor::ones(backend, &[1, n_rows], self.dtype))
            .transpose()?;
        for (tile, (class_start, n_classes)) in self.class_tiles(tiling).enumerate() {
            let rows_and_classes = (block.rows, (class_start, n_classes));
            let dlogits = self.logits(
                rows_and_classes,
                operands.hidden,
                operands.weight,
                operands.bias,
            )?;
            backend.cross_entropy_tile_backward(CrossEntropyTileBackward {
                tile: LogitTile {
                    logits: dlogits.view(),
                    class_start,
                    target: target.view(),
                    ignore_index: self.options.ignore_index,
                },
                classes: self.classes,
                smoothing: self.options.label_smoothing,
                lse: lse.view(),
                scale: scale.view(),
                factor: block.factor.view(),
            })?;
            if let Some(dhidden) = dhidden {
                let weight = operands.weight.narrow(0, class_start, n_classes)?;
                backend.matmul(dlogits.view(), weight.view(), dhidden.view(), tile > 0)?;
            }
            if let Some(dweight) = dweight {
                let rows = dweight.narrow(0, class_start, n_classes)?;
                let first = block.index == 0;
                backend.matmul(dlogits.t()?.view(), hidden.view(), rows.view(), !first)?;
            }
            if let (Some(dbias), Some(ones)) = (dbias, &ones) {
                // The column sums as a product with a row of ones: f32 accumulation like the
                // other products, no scratch of the size of the classes.
                let columns = dbias.narrow(0, class_start, n_classes)?.unsqueeze(0)?;
                backend.matmul(ones.view(), dlogits.view(), columns.view(), true)?;
            }
        }
        Ok(())
    }
}

/// One block of rows in backward: its index, its rows (start, length) and their gradient
/// factors.
struct Block {
    index: usize,
    rows: (usize, usize),
    factor: Tensor,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_as_few_and_as_even_as_the_limit_allows() {
        assert_eq!(balanced(100, 256), 100);
        assert_eq!(balanced(0, 256), 1);
        // 8192 rows under 3776: three blocks of 2752, 2752 and 2688, not 3776, 3776 and 640.
        assert_eq!(balanced(8192, 3776), 2752);
        assert_eq!(balanced(1000, 501), 448);
        // 501 is no multiple of 64: 448, the largest one within it.
        assert_eq!(balanced(1001, 501), 448);
        assert_eq!(balanced(1003, 501), 384);
    }

    /// The Llama-3.2-1B head (8192 tokens, 2048 features, 128,256 classes, bf16) at the default
    /// budget once cuBLAS's workspace is taken: blocks and tiles of one size, a multiple of 64,
    /// the last no shorter than four fifths of it, within the budget.
    #[test]
    fn the_llama_head_is_cut_into_even_blocks_and_tiles() {
        let head = Head {
            rows: 8192,
            features: 2048,
            classes: 128_256,
            dtype: DType::BF16,
            has_bias: false,
            options: LinearCrossEntropyOptions::default(),
            workspace: 0,
        };
        let wants = Wants {
            hidden: true,
            weight: true,
            bias: false,
        };
        for (tiling, accumulator_row) in [
            (head.forward_tiling(), 0),
            (head.backward_tiling(wants), 4 * 2048),
        ] {
            let blocks: Vec<_> = head.row_blocks(tiling).map(|(_, len)| len).collect();
            let tiles: Vec<_> = head.class_tiles(tiling).map(|(_, len)| len).collect();
            assert_eq!(blocks.iter().sum::<usize>(), 8192);
            assert_eq!(tiles.iter().sum::<usize>(), 128_256);
            for pieces in [&blocks, &tiles] {
                let (last, rest) = pieces.split_last().unwrap();
                assert!(
                    rest.iter().all(|&len| len % 64 == 0 && len == pieces[0]),
                    "{pieces:?}"
                );
                assert!(last * 10 >= pieces[0] * 8, "{pieces:?}");
            }
            let bytes =
                tiling.rows * (accumulator_row + ROW_BYTES) + tiling.rows * tiling.classes * 2;
            assert!(
                bytes + 2 * LARGE_BLOCK_SLACK + SMALL_BLOCKS_BYTES <= 64 << 20,
                "{tiling:?}"
            );
        }
        assert_eq!(head.backward_tiling(wants).rows, 2752);
    }
}
