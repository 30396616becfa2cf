//! Misuse of headroom-checkpoint: int8 quantization blocks and buffers that do not fit,
//! `checkpoint_sequential` segment counts, a region that writes its input or whose input changes
//! before backward, offload of CPU tensors.

use std::sync::Arc;

use headroom_autograd_core::Tensor;
use headroom_checkpoint::{
    checkpoint, checkpoint_sequential, dequantize_int8_blockwise, offload, quantize_int8_blockwise,
    CheckpointError, CheckpointOptions, Compression, OffloadOptions,
};
use headroom_ops_cpu::CpuBackend;

use crate::{expect_err, f32s, param, Case, Outcome};
use headroom_testkit::misuse_cases;

pub(crate) fn cases() -> Vec<Case> {
    fn quantize_refused(n: usize, block: usize, n_codes: usize, n_absmax: usize) -> Outcome {
        let x = vec![0.5f32; n];
        let (mut codes, mut absmax) = (vec![0i8; n_codes], vec![0.0f32; n_absmax]);
        expect_err!(
            quantize_int8_blockwise(&x, block, &mut codes, &mut absmax),
            CheckpointError::InvalidArgument {
                op: "quantize_int8_blockwise",
                ..
            }
        )
    }
    /// `checkpoint_sequential` of three tanh blocks in `segments` segments.
    fn sequential_refused(segments: usize) -> Outcome {
        let blocks: Vec<headroom_nn::BlockForward> = (0..3)
            .map(|_| -> headroom_nn::BlockForward { Arc::new(|x: &Tensor| Ok(x.tanh()?)) })
            .collect();
        let x = param(&CpuBackend::new_ref(), &[0.5; 4])?;
        expect_err!(
            checkpoint_sequential(&blocks, segments, &x, &CheckpointOptions::default()),
            CheckpointError::InvalidArgument {
                op: "checkpoint_sequential",
                ..
            }
        )
    }
    misuse_cases![
        int8_quantize_with_block_of_3_is_invalid_argument => quantize_refused(12, 3, 12, 4),
        int8_quantize_with_block_of_0_is_invalid_argument => quantize_refused(12, 0, 12, 0),
        int8_quantize_with_block_past_the_range_is_invalid_argument => {
            let block = 2 * headroom_checkpoint::INT8_BLOCK_RANGE.end();
            quantize_refused(block, block, block, 1)
        },
        int8_quantize_with_too_few_codes_is_invalid_argument => quantize_refused(512, 256, 511, 2),
        int8_dequantize_with_too_many_absmax_values_is_invalid_argument => {
            let (codes, absmax) = (vec![0i8; 512], vec![1.0f32; 3]);
            let mut out = vec![0.0f32; 512];
            expect_err!(
                dequantize_int8_blockwise(&codes, &absmax, 256, &mut out),
                CheckpointError::InvalidArgument {
                    op: "dequantize_int8_blockwise",
                    ..
                }
            )
        },
        compression_with_block_of_3_is_invalid_argument => {
            expect_err!(
                Compression::Int8Blockwise { block: 3 }.check(),
                CheckpointError::InvalidArgument { .. },
                naming "block size 3"
            )
        },
        checkpoint_sequential_in_0_segments_is_invalid_argument => sequential_refused(0),
        checkpoint_sequential_in_more_segments_than_blocks_is_invalid_argument =>
            sequential_refused(4),
        a_checkpointed_region_writing_its_input_is_region_writes_input => {
            let cpu = CpuBackend::new_ref();
            let x = f32s(&cpu, &[0.5; 4], &[4])?;
            let w = param(&cpu, &[1.0; 4])?;
            expect_err!(
                checkpoint(
                    |xs| {
                        xs[0].fill_(2.0)?;
                        Ok(vec![xs[0].mul(&xs[1])?])
                    },
                    &[x, w]
                ),
                CheckpointError::RegionWritesInput { input: 0 }
            )
        },
        an_input_modified_after_a_checkpointed_forward_is_input_modified => {
            let cpu = CpuBackend::new_ref();
            let x = f32s(&cpu, &[0.5; 4], &[4])?;
            let w = param(&cpu, &[1.0; 4])?;
            let y = checkpoint(|xs| Ok(vec![xs[0].mul(&xs[1])?.tanh()?]), &[x.clone(), w])?;
            x.fill_(3.0)?;
            let err = match y[0].sum_all()?.backward() {
                Ok(()) => return Err("expected InputModified, got Ok".into()),
                Err(err) => err,
            };
            match err.hook_source::<CheckpointError>() {
                Some(CheckpointError::InputModified { input: 0, .. }) => Ok(()),
                _ => Err(format!("expected InputModified, got {err:?}").into()),
            }
        },
        offloading_cpu_tensors_is_offload_needs_cuda => {
            let cpu = CpuBackend::new_ref();
            let x = param(&cpu, &[0.5; 4])?;
            expect_err!(
                offload(
                    |xs| Ok(vec![xs[0].tanh()?]),
                    &[x],
                    &OffloadOptions::default()
                ),
                CheckpointError::OffloadNeedsCuda { .. }
            )
        },
    ]
}
