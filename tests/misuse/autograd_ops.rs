//! Misuse of headroom-autograd-core's tensor ops, on the CPU backend: shapes that do not
//! broadcast or fit, dims out of range, sizes that overflow, views past their buffer, arguments
//! out of range, dtypes an op does not take, tensors of two backends in one op. The graph's
//! misuse (backward, gradients, in-place writes, hooks) is in `autograd_graph`.

use std::sync::Arc;

use headroom_autograd_core::{
    cat, cross_entropy, dropout, embedding, layer_norm, patch_embedding,
    scaled_dot_product_attention, BackendRef, DType, Generator, Reduction, Tensor, TensorError,
};
use headroom_caching_allocator::{AllocError, AllocatorConfig, CachingAllocator, HostStorage};
use headroom_ops_cpu::CpuBackend;

use crate::{expect_eq, expect_err, f32s, Case};
use headroom_testkit::misuse_cases;

pub(crate) fn cases() -> Vec<Case> {
    misuse_cases![
        adding_unbroadcastable_shapes_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            let b = Tensor::zeros(&cpu, &[4], DType::F32)?;
            expect_err!(a.add(&b), TensorError::ShapeMismatch { op: "add", .. })
        },
        matmul_of_mismatched_inner_dims_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            let b = Tensor::zeros(&cpu, &[4, 5], DType::F32)?;
            expect_err!(
                a.matmul(&b),
                TensorError::ShapeMismatch { op: "matmul", .. }
            )
        },
        reshape_to_another_element_count_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[6], DType::F32)?;
            expect_err!(
                a.reshape(&[4]),
                TensorError::InvalidArgument { op: "reshape", .. },
                naming "6 elements"
            )
        },
        narrow_past_the_end_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[4], DType::F32)?;
            expect_err!(
                a.narrow(0, 2, 5),
                TensorError::InvalidArgument { op: "narrow", .. }
            )
        },
        narrow_with_a_start_near_usize_max_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[4], DType::F32)?;
            expect_err!(
                a.narrow(0, usize::MAX, 2),
                TensorError::InvalidArgument { op: "narrow", .. }
            )
        },
        transpose_of_a_dim_out_of_range_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            expect_err!(
                a.transpose(0, 5),
                TensorError::InvalidArgument { op: "transpose", .. },
                naming "dim 5"
            )
        },
        expand_to_an_incompatible_shape_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[3], DType::F32)?;
            expect_err!(
                a.expand(&[2, 4]),
                TensorError::ShapeMismatch { op: "expand", .. }
            )
        },
        as_strided_past_the_buffer_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[4], DType::F32)?;
            expect_err!(
                a.as_strided(&[4], &[2], 0),
                TensorError::InvalidArgument {
                    op: "as_strided",
                    ..
                }
            )
        },
        softmax_over_a_dim_out_of_range_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            expect_err!(
                a.softmax(2),
                TensorError::InvalidArgument { op: "softmax", .. }
            )
        },
        cat_of_mismatched_shapes_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            let b = Tensor::zeros(&cpu, &[2, 4], DType::F32)?;
            expect_err!(
                cat(&[&a, &b], 0),
                TensorError::ShapeMismatch { op: "cat", .. }
            )
        },
        adding_f32_to_f64_is_dtype_mismatch => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[2], DType::F32)?;
            let b = Tensor::zeros(&cpu, &[2], DType::F64)?;
            expect_err!(a.add(&b), TensorError::DtypeMismatch { op: "add", .. })
        },
        from_slice_with_too_few_elements_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            expect_err!(
                Tensor::from_slice(&cpu, &[1.0f32, 2.0, 3.0], &[2, 2]),
                TensorError::InvalidArgument {
                    op: "from_slice",
                    ..
                }
            )
        },
        a_shape_too_large_to_count_is_size_overflow => {
            let cpu = CpuBackend::new_ref();
            expect_err!(
                Tensor::zeros(&cpu, &[usize::MAX, 2], DType::F32),
                TensorError::SizeOverflow { .. }
            )
        },
        a_tensor_past_its_backends_memory_is_alloc_out_of_memory => {
            let small: BackendRef = Arc::new(CpuBackend::new(CachingAllocator::new(
                HostStorage::with_capacity(1 << 20),
                AllocatorConfig::default(),
            )));
            expect_err!(
                Tensor::zeros(&small, &[1 << 20], DType::F32),
                TensorError::Alloc(AllocError::OutOfMemory(report))
                    if report.requested == 4 << 20
            )
        },
        tensors_of_two_backends_in_one_op_is_invalid_argument => {
            let (one, other) = (CpuBackend::new_ref(), CpuBackend::new_ref());
            let a = Tensor::ones(&one, &[2], DType::F32)?;
            let b = Tensor::ones(&other, &[2], DType::F32)?;
            expect_err!(
                a.add(&b),
                TensorError::InvalidArgument { op: "binary", .. },
                naming "another backend"
            )
        },
        writing_into_an_expanded_view_is_overlap => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[1], DType::F32)?.expand(&[4])?;
            expect_err!(a.fill_(1.0), TensorError::Overlap { op: "fill_", .. })
        },
        dropout_with_probability_above_1_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::ones(&cpu, &[4], DType::F32)?;
            expect_err!(
                dropout(&x, 1.5, true, &Generator::new(0)),
                TensorError::InvalidArgument { op: "dropout", .. }
            )
        },
        cross_entropy_with_a_target_past_the_classes_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let logits = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            let target = Tensor::from_slice(&cpu, &[0i64, 7], &[2])?;
            expect_err!(
                cross_entropy(&logits, &target, -100, Reduction::Mean),
                TensorError::InvalidArgument { op: "cross_entropy", .. },
                naming "target 7"
            )
        },
        gather_with_an_index_out_of_range_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            let index = Tensor::from_slice(&cpu, &[0i64, 3], &[2, 1])?;
            expect_err!(
                x.gather(1, &index),
                TensorError::InvalidArgument { op: "gather", .. },
                naming "index 3"
            )
        },
        split_into_pieces_of_0_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[4], DType::F32)?;
            expect_err!(
                x.split(0, 0),
                TensorError::InvalidArgument { op: "split", .. }
            )
        },
        split_with_sizes_that_miss_the_dim_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[4], DType::F32)?;
            expect_err!(
                x.split_with_sizes(&[1, 1], 0),
                TensorError::InvalidArgument { op: "split", .. }
            )
        },
        permute_with_a_repeated_dim_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            expect_err!(
                x.permute(&[0, 0]),
                TensorError::InvalidArgument { op: "permute", .. }
            )
        },
        // PyTorch raises "dim 0 appears multiple times"; Headroom reduces the dim once.
        sum_over_a_repeated_dim_reduces_it_once => {
            let cpu = CpuBackend::new_ref();
            let x = f32s(&cpu, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
            expect_eq(x.sum(&[0, 0], false)?.to_vec::<f32>()?, vec![5.0, 7.0, 9.0])
        },
        max_over_an_empty_dim_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[0, 3], DType::F32)?;
            expect_err!(x.max_dim(0, false), TensorError::ShapeMismatch { .. })
        },
        reshape_inferred_with_two_unknowns_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[6], DType::F32)?;
            expect_err!(
                x.reshape_inferred(&[-1, -1]),
                TensorError::InvalidArgument { op: "reshape", .. }
            )
        },
        reshape_inferred_beside_a_zero_dim_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[6], DType::F32)?;
            expect_err!(
                x.reshape_inferred(&[0, -1]),
                TensorError::InvalidArgument { op: "reshape", .. }
            )
        },
        reshape_inferred_with_a_negative_size_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[6], DType::F32)?;
            expect_err!(
                x.reshape_inferred(&[-2, -3]),
                TensorError::InvalidArgument { op: "reshape", .. }
            )
        },
        as_strided_with_an_overflowing_stride_is_size_overflow => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[4], DType::F32)?;
            expect_err!(
                x.as_strided(&[2], &[usize::MAX], 0),
                TensorError::SizeOverflow {
                    op: "as_strided",
                    ..
                }
            )
        },
        expand_to_more_elements_than_usize_counts_is_size_overflow => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[1, 3], DType::F32)?;
            expect_err!(
                x.expand(&[usize::MAX, 3]),
                TensorError::SizeOverflow { op: "expand", .. }
            )
        },
        cat_of_no_tensors_is_invalid_argument =>
            expect_err!(cat(&[], 0), TensorError::InvalidArgument { op: "cat", .. }),
        cat_along_a_dim_out_of_range_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let a = Tensor::zeros(&cpu, &[2], DType::F32)?;
            expect_err!(
                cat(&[&a, &a], 3),
                TensorError::InvalidArgument { op: "cat", .. }
            )
        },
        flatten_with_start_after_end_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 3, 4], DType::F32)?;
            expect_err!(
                x.flatten(2, 0),
                TensorError::InvalidArgument { op: "flatten", .. }
            )
        },
        unsqueeze_past_the_last_position_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            expect_err!(
                x.unsqueeze(4),
                TensorError::InvalidArgument {
                    op: "unsqueeze",
                    ..
                }
            )
        },
        matmul_of_a_scalar_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let s = Tensor::scalar(&cpu, 2.0, DType::F32)?;
            let m = Tensor::ones(&cpu, &[2, 2], DType::F32)?;
            expect_err!(
                s.matmul(&m),
                TensorError::InvalidArgument { op: "matmul", .. }
            )
        },
        masked_fill_with_a_float_mask_is_unsupported_dtype => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::ones(&cpu, &[2], DType::F32)?;
            let mask = Tensor::ones(&cpu, &[2], DType::F32)?;
            expect_err!(
                x.masked_fill(&mask, 0.0),
                TensorError::UnsupportedDtype {
                    op: "masked_fill",
                    dtype: DType::F32
                }
            )
        },
        layer_norm_with_a_weight_of_another_shape_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::ones(&cpu, &[2, 4], DType::F32)?;
            let weight = Tensor::ones(&cpu, &[3], DType::F32)?;
            expect_err!(
                layer_norm(&x, &[4], Some(&weight), None, 1e-5),
                TensorError::ShapeMismatch {
                    op: "layer_norm",
                    ..
                }
            )
        },
        layer_norm_over_a_shape_the_input_does_not_end_with_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::ones(&cpu, &[2, 4], DType::F32)?;
            expect_err!(
                layer_norm(&x, &[5], None, None, 1e-5),
                TensorError::ShapeMismatch {
                    op: "layer_norm",
                    ..
                }
            )
        },
        attention_of_mismatched_key_and_query_widths_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let q = Tensor::ones(&cpu, &[1, 2, 4, 8], DType::F32)?;
            let kv = Tensor::ones(&cpu, &[1, 2, 4, 6], DType::F32)?;
            expect_err!(
                scaled_dot_product_attention(&q, &kv, &kv, false, None),
                TensorError::ShapeMismatch {
                    op: "attention",
                    ..
                }
            )
        },
        patch_embedding_with_patches_of_0_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let images = Tensor::ones(&cpu, &[1, 3, 4, 4], DType::F32)?;
            let weight = Tensor::ones(&cpu, &[2, 3, 2, 2], DType::F32)?;
            expect_err!(
                patch_embedding(&images, &weight, None, 0),
                TensorError::ShapeMismatch {
                    op: "patch_embedding",
                    ..
                }
            )
        },
        embedding_of_a_one_dimensional_weight_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let weight = Tensor::ones(&cpu, &[4], DType::F32)?;
            let ids = Tensor::from_slice(&cpu, &[0i64, 1], &[2])?;
            expect_err!(
                embedding(&weight, &ids),
                TensorError::InvalidArgument {
                    op: "embedding",
                    ..
                }
            )
        },
        to_vec_of_another_element_type_converts_each_value => {
            let cpu = CpuBackend::new_ref();
            let x = f32s(&cpu, &[1.5, -2.0], &[2])?;
            expect_eq(x.to_vec::<f64>()?, vec![1.5, -2.0])
        },
        item_of_two_elements_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::ones(&cpu, &[2], DType::F32)?;
            expect_err!(x.item(), TensorError::InvalidArgument { op: "item", .. })
        },
        cross_entropy_with_targets_of_another_count_is_shape_mismatch => {
            let cpu = CpuBackend::new_ref();
            let logits = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            let target = Tensor::from_slice(&cpu, &[0i64, 1, 2], &[3])?;
            expect_err!(
                cross_entropy(&logits, &target, -100, Reduction::Mean),
                TensorError::ShapeMismatch {
                    op: "cross_entropy",
                    ..
                }
            )
        },
        cross_entropy_with_float_targets_is_dtype_mismatch => {
            let cpu = CpuBackend::new_ref();
            let logits = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            let target = Tensor::zeros(&cpu, &[2], DType::F32)?;
            expect_err!(
                cross_entropy(&logits, &target, -100, Reduction::Mean),
                TensorError::DtypeMismatch {
                    op: "cross_entropy",
                    lhs: DType::I64,
                    rhs: DType::F32
                }
            )
        },
        flatten_to_a_dim_out_of_range_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 3, 4], DType::F32)?;
            expect_err!(
                x.flatten(0, 5),
                TensorError::InvalidArgument { op: "flatten", .. }
            )
        },
        squeeze_of_a_dim_out_of_range_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 1], DType::F32)?;
            expect_err!(
                x.squeeze_dim(5),
                TensorError::InvalidArgument { op: "squeeze", .. }
            )
        },
        narrow_of_a_dim_out_of_range_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            expect_err!(
                x.narrow(-3, 0, 1),
                TensorError::InvalidArgument { op: "narrow", .. }
            )
        },
        split_along_a_dim_out_of_range_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            expect_err!(
                x.split(1, 2),
                TensorError::InvalidArgument { op: "split", .. }
            )
        },
        sum_over_a_dim_out_of_range_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            expect_err!(
                x.sum(&[2], true),
                TensorError::InvalidArgument { op: "sum", .. }
            )
        },
        max_over_a_dim_out_of_range_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            expect_err!(
                x.max_dim(-3, false),
                TensorError::InvalidArgument { op: "max", .. }
            )
        },
        permute_with_too_few_dims_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            expect_err!(
                x.permute(&[0]),
                TensorError::InvalidArgument { op: "permute", .. }
            )
        },
        permute_with_a_dim_out_of_range_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            expect_err!(
                x.permute(&[0, 5]),
                TensorError::InvalidArgument { op: "permute", .. }
            )
        },
        gather_along_a_dim_out_of_range_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
            let index = Tensor::from_slice(&cpu, &[0i64, 1], &[2, 1])?;
            expect_err!(
                x.gather(4, &index),
                TensorError::InvalidArgument { op: "gather", .. }
            )
        },
        log_softmax_of_a_scalar_along_dim_1_is_invalid_argument => {
            let cpu = CpuBackend::new_ref();
            let x = Tensor::scalar(&cpu, 1.0, DType::F32)?;
            expect_err!(
                x.log_softmax(1),
                TensorError::InvalidArgument {
                    op: "log_softmax",
                    ..
                }
            )
        },
    ]
}
