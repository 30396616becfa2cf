//! The argument structs of the cross-entropy primitives: the whole-row loss
//! ([`CrossEntropyForward`], [`CrossEntropyBackward`] over [`CrossEntropyArgs`]) and the tiles of
//! a chunked loss ([`LogitTile`], [`CrossEntropyTile`], [`CrossEntropyTileBackward`]), which
//! `linear_cross_entropy` runs over logits it never holds whole; and the tiles' shape rule
//! ([`cross_entropy_tile_dims`]), shared by every backend.
//!
//! It sits on views and dtypes; it knows no backend and no op.

use crate::dtype::{stats_dtype, DType};
use crate::error::{Result, TensorError};

use super::args::{Operands, Reduction, View};

/// The logits and targets of fused cross-entropy (log-softmax + NLL over the last dim).
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyArgs<'a> {
    /// Logits, dense `[rows, classes]`.
    pub logits: View<'a>,
    /// Class indices, `[rows]`, I64.
    pub target: View<'a>,
    /// Samples with this target contribute nothing.
    pub ignore_index: i64,
    /// How to combine per-sample losses.
    pub reduction: Reduction,
}

/// Inputs and outputs of [`Backend::cross_entropy`](super::Backend::cross_entropy).
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyForward<'a> {
    /// The logits, the targets and how the losses combine.
    pub input: CrossEntropyArgs<'a>,
    /// The reduced loss, 0-dim: the logits' dtype, or f32 for f16 and bf16 logits.
    pub loss: View<'a>,
    /// Each row's log-sum-exp, `[rows]` in the stats dtype (f32; f64 for f64 logits).
    pub lse: View<'a>,
}

impl<'a> CrossEntropyForward<'a> {
    /// `loss` and `lse` written; the logits and targets read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new(
            [self.loss, self.lse],
            [self.input.logits, self.input.target],
        )
    }
}

/// Inputs and outputs of [`Backend::cross_entropy_backward`](super::Backend::cross_entropy_backward).
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyBackward<'a> {
    /// The forward's logits, targets and reduction.
    pub input: CrossEntropyArgs<'a>,
    /// The forward's per-row log-sum-exp.
    pub lse: View<'a>,
    /// The loss's gradient, 0-dim, of the loss's dtype.
    pub dloss: View<'a>,
    /// The logits' gradient, dense like them (written).
    pub dlogits: View<'a>,
}

impl<'a> CrossEntropyBackward<'a> {
    /// `dlogits` written; the logits, targets, `lse` and `dloss` read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new(
            [self.dlogits],
            [self.input.logits, self.input.target, self.lse, self.dloss],
        )
    }
}

/// A tile of logits: rows × a range of classes, with each row's target.
#[derive(Debug, Clone, Copy)]
pub struct LogitTile<'a> {
    /// The tile's logits, dense `[rows, n]`.
    pub logits: View<'a>,
    /// The class of the tile's first column (the tile holds `class_start..class_start + n`).
    pub class_start: usize,
    /// Each row's class, `[rows]` I64 (may be strided). Not validated by the tile primitives
    /// (the caller checks them once): a target outside the tile is simply not in it.
    pub target: View<'a>,
    /// Rows whose target is this have no target in any tile.
    pub ignore_index: i64,
}

/// One tile of a chunked cross-entropy's forward: a tile of logits folded into each row's
/// running statistics, so the log-sum-exp of a row never needs the whole row at once.
///
/// For each row `r` with `x` its logits in the tile: `(row_max[r], row_sum[r])` becomes the
/// online merge of itself with `(max x, Σ exp(x − max x))` (start them at `−∞` and 0: the row's
/// log-sum-exp is then `row_max + ln row_sum` after its last tile); `target_logit[r]` is set to
/// the target's logit when the target falls in the tile (left as it is otherwise, and for
/// ignored rows); `logit_sum[r]`, when given, gains `Σ x` (label smoothing's term). Statistics
/// are dense `[rows]` in the stats dtype (f32; f64 for f64 logits) and accumulate in it.
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyTile<'a> {
    /// The tile.
    pub tile: LogitTile<'a>,
    /// Running maximum, updated.
    pub row_max: View<'a>,
    /// Running `Σ exp(x − row_max)`, updated.
    pub row_sum: View<'a>,
    /// The target's logit, written where the target is in the tile.
    pub target_logit: View<'a>,
    /// Each row's sum of logits, added to when given.
    pub logit_sum: Option<View<'a>>,
}

impl<'a> CrossEntropyTile<'a> {
    /// The running statistics written; the logits and targets read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new(
            [
                Some(self.row_max),
                Some(self.row_sum),
                Some(self.target_logit),
                self.logit_sum,
            ],
            [self.tile.logits, self.tile.target],
        )
    }
}

/// One tile of a chunked cross-entropy's backward: the tile's logits overwritten, in place, by
/// their gradient.
///
/// For row `r` and class `c` of the tile:
/// `x ← exp(x − lse[r]) · scale[r] − factor[r] · (smoothing / classes + (1 − smoothing) · [c == target[r]])`,
/// computed in the stats dtype and rounded once into the logits' dtype. `factor[r]` is the row's
/// share of the loss's gradient (0 for an ignored row, whose target then adds nothing), and
/// `scale[r]` the softmax's coefficient (`factor · (1 + 2 · z_loss · lse)` with a z-loss, else
/// `factor`). The per-row vectors are dense `[rows]` in the stats dtype.
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyTileBackward<'a> {
    /// The tile, whose logits are read, then overwritten by their gradient.
    pub tile: LogitTile<'a>,
    /// All classes of the loss (not the tile's): label smoothing spreads over them.
    pub classes: usize,
    /// Label smoothing `ε` in `[0, 1]`.
    pub smoothing: f64,
    /// Each row's log-sum-exp over all classes.
    pub lse: View<'a>,
    /// The softmax's coefficient per row.
    pub scale: View<'a>,
    /// The row's share of the loss's gradient.
    pub factor: View<'a>,
}

impl<'a> CrossEntropyTileBackward<'a> {
    /// The logits written (in place); targets and per-row vectors read.
    pub fn operands(&self) -> Operands<'a> {
        Operands::new(
            [self.tile.logits],
            [self.tile.target, self.lse, self.scale, self.factor],
        )
    }
}

/// The shape and dtype rule of the tile primitives, shared by every backend: dense 2-D float
/// logits `[rows, n]`, I64 targets `[rows]`, and every per-row vector dense `[rows]` in the
/// logits' stats dtype. Returns `(rows, n)`.
pub fn cross_entropy_tile_dims(
    op: &'static str,
    tile: &LogitTile<'_>,
    per_row: &[&View<'_>],
) -> Result<(usize, usize)> {
    let (logits, target) = (&tile.logits, &tile.target);
    let [rows, n] = *logits.layout.shape() else {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "logits must be [rows, classes], not {:?}",
                logits.layout.shape()
            ),
        });
    };
    if !logits.dtype.is_float() {
        return Err(TensorError::UnsupportedDtype {
            op,
            dtype: logits.dtype,
        });
    }
    if !logits.layout.is_contiguous() {
        return Err(TensorError::InvalidArgument {
            op,
            reason: "the tile's logits must be dense".into(),
        });
    }
    if target.dtype != DType::I64 {
        return Err(TensorError::DtypeMismatch {
            op,
            lhs: DType::I64,
            rhs: target.dtype,
        });
    }
    let stats = stats_dtype(logits.dtype);
    for view in std::iter::once(target).chain(per_row.iter().copied()) {
        if view.layout.shape() != [rows] {
            return Err(TensorError::ShapeMismatch {
                op,
                lhs: vec![rows],
                rhs: view.layout.shape().to_vec(),
            });
        }
    }
    for view in per_row {
        if view.dtype != stats {
            return Err(TensorError::DtypeMismatch {
                op,
                lhs: stats,
                rhs: view.dtype,
            });
        }
        if !view.layout.is_contiguous() {
            return Err(TensorError::InvalidArgument {
                op,
                reason: "the per-row vectors must be dense".into(),
            });
        }
    }
    Ok((rows, n))
}
