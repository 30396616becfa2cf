//! Misuse of headroom-autograd-core's graph, on the CPU backend: backward without a gradient,
//! twice, or of a tensor that needs none; in-place writes to a saved tensor or a leaf;
//! `requires_grad`, gradients and hooks where they do not fit; an op on a buffer another op has
//! claimed. The tensor ops' misuse is in `autograd_ops`.

use headroom_autograd_core::{Access, BackwardOptions, DType, HostAccess, Tensor, TensorError};
use headroom_ops_cpu::CpuBackend;

use crate::autograd_ops::refused;
use crate::autograd_ops::Refusal::{self, Autograd, DtypeMismatch, ShapeMismatch};
use crate::{expect_eq, expect_err, f32s, param, Case, Outcome};
use headroom_testkit::misuse_cases;

pub(crate) fn cases() -> Vec<Case> {
    /// Setting a gradient of `shape` and `dtype` on a parameter of two f32 elements.
    fn set_grad_refused(shape: &[usize], dtype: DType, expected: Refusal) -> Outcome {
        let cpu = CpuBackend::new_ref();
        let x = param(&cpu, &[1.0, 2.0])?;
        refused(
            x.set_grad(Some(Tensor::ones(&cpu, shape, dtype)?)),
            expected,
        )
    }
    misuse_cases![
        backward_of_a_non_scalar_without_a_gradient_is_autograd_error => {
            let cpu = CpuBackend::new_ref();
            let x = param(&cpu, &[1.0, 2.0])?;
            expect_err!(
                x.exp()?.backward(),
                TensorError::Autograd { op: "backward", .. },
                naming "one-element"
            )
        },
        backward_with_a_gradient_of_another_shape_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let x = param(&cpu, &[1.0, 2.0])?;
            let gradient = Tensor::ones(&cpu, &[3], DType::F32)?;
            expect_err!(
                x.exp()?.backward_with(
                    Some(gradient),
                    BackwardOptions {
                        retain_graph: false
                    }
                ),
                TensorError::ShapeMismatch { op: "backward", .. }
            )
        },
        backward_of_a_tensor_that_does_not_require_grad_is_autograd_error => {
            let cpu = CpuBackend::new_ref();
            let x = f32s(&cpu, &[1.0, 2.0], &[2])?;
            expect_err!(x.sum_all()?.backward(), TensorError::Autograd { .. })
        },
        writing_a_saved_tensor_in_place_then_backward_is_modified_in_place => {
            let cpu = CpuBackend::new_ref();
            let x = param(&cpu, &[0.5, 1.0])?;
            let y = x.exp()?; // saves its output
            y.add_(&f32s(&cpu, &[1.0], &[1])?)?;
            expect_err!(
                y.sum_all()?.backward(),
                TensorError::ModifiedInPlace {
                    op: "exp",
                    saved_version: 0,
                    current_version: 1
                }
            )
        },
        backward_twice_without_retain_graph_is_graph_freed => {
            let cpu = CpuBackend::new_ref();
            let x = param(&cpu, &[0.5, 1.0])?;
            let loss = x.exp()?.sum_all()?;
            loss.backward()?;
            expect_err!(loss.backward(), TensorError::GraphFreed { .. })
        },
        in_place_write_to_a_leaf_that_requires_grad_is_autograd_error =>
            refused(param(&CpuBackend::new_ref(), &[0.5, 1.0])?.fill_(0.0), Autograd("fill_")),
        requires_grad_on_an_integer_tensor_is_unsupported_dtype => {
            let cpu = CpuBackend::new_ref();
            let ids = Tensor::from_slice(&cpu, &[1i64, 2], &[2])?;
            expect_err!(
                ids.requires_grad_(true),
                TensorError::UnsupportedDtype {
                    op: "requires_grad_",
                    dtype: DType::I64
                }
            )
        },
        requires_grad_on_a_non_leaf_is_autograd_error => {
            let y = param(&CpuBackend::new_ref(), &[1.0])?.exp()?;
            refused(y.requires_grad_(false), Autograd("requires_grad_"))
        },
        set_grad_of_another_shape_is_shape_mismatch =>
            set_grad_refused(&[3], DType::F32, ShapeMismatch("set_grad")),
        an_op_writing_a_buffer_claimed_by_a_reader_is_concurrent_access => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[4], DType::F32)?;
            let reading = HostAccess::claim("reader", [(&**x.buffer(), Access::Read)])?;
            let res = expect_err!(
                x.fill_(1.0),
                TensorError::ConcurrentAccess {
                    op: "fill",
                    what: "an output"
                }
            );
            drop(reading);
            // Released: the write goes through and nothing was half-written before.
            res.and_then(|()| {
                expect_eq(x.to_vec::<f32>()?, vec![0.0; 4])?;
                x.fill_(1.0)?;
                expect_eq(x.to_vec::<f32>()?, vec![1.0; 4])
            })
        },
        an_op_reading_a_buffer_claimed_by_a_writer_is_concurrent_access => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[4], DType::F32)?;
            let _writing = HostAccess::claim("writer", [(&**x.buffer(), Access::Write)])?;
            expect_err!(
                x.exp(),
                TensorError::ConcurrentAccess {
                    what: "an input",
                    ..
                }
            )
        },
        set_grad_of_another_dtype_is_dtype_mismatch =>
            set_grad_refused(&[2], DType::F64, DtypeMismatch("set_grad")),
        register_hook_on_a_tensor_without_grad_is_autograd_error => {
            let x = Tensor::ones(&CpuBackend::new_ref(), &[2], DType::F32)?;
            refused(x.register_hook(|_| Ok(None)), Autograd("register_hook"))
        },
    ]
}
