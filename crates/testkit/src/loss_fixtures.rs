//! Fixtures the fused-loss tests of more than one crate share: [`labels_every_ninth_ignored`],
//! the label pattern of the CPU and CUDA linear-cross-entropy suites, and [`OneOpInBf16`], an
//! autocast policy that lowers a single op, so a test sees exactly which op autocast reached.

use headroom_autograd_core::{AutocastPolicy, BackendRef, CastPolicy, DType, Device, Tensor};

use crate::Result;

/// The class index of an ignored row (PyTorch's `ignore_index` default).
pub const IGNORE_INDEX: i64 = -100;

/// `tokens` labels below `classes`, spread by a large prime, with every ninth row (from row 4)
/// [`IGNORE_INDEX`]; I64 `[tokens]` on `backend`.
pub fn labels_every_ninth_ignored(
    backend: &BackendRef,
    tokens: usize,
    classes: usize,
) -> Result<Tensor> {
    let labels: Vec<i64> = (0..tokens as i64)
        .map(|i| {
            if i % 9 == 4 {
                IGNORE_INDEX
            } else {
                (i * 7919) % classes as i64
            }
        })
        .collect();
    Ok(Tensor::from_slice(backend, &labels, &[tokens])?)
}

/// Autocast that runs the op it names (a name in
/// [`AUTOCAST_OPS`](headroom_autograd_core::AUTOCAST_OPS)) in bf16 on every device and leaves
/// every other op alone.
#[derive(Debug, Clone, Copy)]
pub struct OneOpInBf16(pub &'static str);

impl AutocastPolicy for OneOpInBf16 {
    fn lower_precision(&self) -> DType {
        DType::BF16
    }

    fn cast_policy(&self, op: &'static str, _device: Device) -> CastPolicy {
        if op == self.0 {
            CastPolicy::LowerPrecision
        } else {
            CastPolicy::Keep
        }
    }
}
