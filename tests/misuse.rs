//! The misuse suite over the public Rust APIs: every crate handed bad input — settings out of
//! range, shapes that do not fit, buffers of another allocator, calls out of order — answers
//! with its typed error (or a checked result), never a panic and never a silent wrong value.
//!
//! One table of named cases, each a closure returning its outcome, and one checker that runs
//! them all (each under `catch_unwind`: a panic is a failure), collects every failure and
//! panics once listing them. Cases in [`KNOWN_BUGS`] are bugs found by this suite and not fixed
//! yet: they must fail (the checker prints why), so fixing one fails this test until its name
//! leaves the list. The C ABI's misuse suite is `crates/torch-allocator/tests/c_abi_misuse.rs`
//! (process-wide state, so its own binary); the Python one is in `crates/python`.
//!
//! Everything runs on the CPU backend, host memory or a simulated device: no GPU needed.

use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

use headroom_amp::{AmpError, AmpPolicy, GradScaler, GradScalerConfig, MasterWeights, OptLevel};
use headroom_autograd_core::{
    cat, cross_entropy, dropout, embedding, layer_norm, patch_embedding,
    scaled_dot_product_attention, Access, BackendRef, BackwardOptions, CastPolicy, DType,
    Generator, HostAccess, Reduction, Tensor, TensorError,
};
use headroom_caching_allocator::{
    read_json, read_pickle, read_trace_tsv, AllocError, AllocatorConfig, CachingAllocator,
    HostStorage, SimulatedStorage, StreamId,
};
use headroom_checkpoint::{
    checkpoint, checkpoint_sequential, dequantize_int8_blockwise, offload, quantize_int8_blockwise,
    CheckpointError, CheckpointOptions, Compression, OffloadOptions,
};
use headroom_distributed::{
    Communicator, DistributedError, FileRendezvous, InProcessComm, InProcessGroup, ReduceOp,
    ShardClipping, ShardConfig, ShardLayout, ShardedOptimizer, UniqueId,
};
use headroom_hooks::{ClipMode, Clipping, HooksError, InBackward, InBackwardConfig};
use headroom_nn::{
    load_file, save_file, Gpt2Config, Gpt2LMHeadModel, Linear, NnError, VisionTransformer,
    VitConfig,
};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::{
    adam8bit_blockwise, adam_fused, dynamic_map, n_blocks, AdafactorConfig, Adam8bitBuffers,
    Adam8bitConfig, AdamBuffers, AdamConfig, GradScaling, SgdConfig,
};
use headroom_optim::{
    clip_grad_norm_, clip_grad_value_, Adafactor, Adam, Adam8bit, AdamStochastic,
    AdamStochasticConfig, DeviceGradScaling, Implementation, LossScaler, LrScheduler, NormType,
    OptimError, Optimizer, ParamGroup, Scaling, Schedule, Sgd, StepParams,
};
use headroom_testkit::misuse::{check_misuse, MisuseCase};

/// What a case returns: `Ok` when the API answered as it must, else what it did instead. Setup
/// errors (`?`) are failures too.
type Outcome = Result<(), OutcomeError>;

/// Why a case failed.
type OutcomeError = Box<dyn Error + Send + Sync>;

/// A named misuse and the check of the API's answer.
type Case = MisuseCase<OutcomeError>;

/// Cases that fail today because of a bug in the library (described in each entry's comment);
/// the checker asserts that exactly these fail, so a fix must remove its entry.
const KNOWN_BUGS: &[&str] = &[
    // Empty: the fifteen this suite found (flatten with start after end, Adafactor's negative
    // decay and eps, a negative clip norm, three unchecked schedules, step 0 in two raw kernels,
    // a zero host gradient scale, param_step out of range twice, a usize::MAX group, and
    // ShardLayout over 0 ranks or outside them) are fixed.
];

/// Today's count of cases, so that a case lost from the table fails the test (issue 27 asks 60
/// over the Rust, C and Python suites together).
const MIN_CASES: usize = 225;

/// `Ok` when `$call` fails with an error matching `$pattern` (and, with `naming`, whose message
/// contains the text), else a description of what it returned.
macro_rules! expect_err {
    ($call:expr, $pattern:pat $(if $guard:expr)?) => {
        expect_err!($call, $pattern $(if $guard)?, naming "")
    };
    ($call:expr, $pattern:pat $(if $guard:expr)?, naming $text:expr) => {
        match $call {
            Err(err) if matches!(&err, $pattern $(if $guard)?) => {
                let message = err.to_string();
                if message.contains($text) {
                    Ok(())
                } else {
                    Err(format!("the message does not name {:?}: {message}", $text).into())
                }
            }
            Err(err) => {
                Err(format!("expected {}, got {err:?}", stringify!($pattern)).into())
            }
            Ok(value) => Err(format!(
                "expected {}, got Ok({})",
                stringify!($pattern),
                std::any::type_name_of_val(&value)
            )
            .into()),
        }
    };
}

/// `Ok` when `got == expected`.
fn expect_eq<T: PartialEq + std::fmt::Debug>(got: T, expected: T) -> Outcome {
    if got == expected {
        Ok(())
    } else {
        Err(format!("expected {expected:?}, got {got:?}").into())
    }
}

#[test]
fn every_public_api_refuses_misuse_with_a_typed_error() {
    let cases: Vec<Case> = [
        allocator_cases(),
        autograd_cases(),
        optim_cases(),
        amp_cases(),
        hooks_cases(),
        checkpoint_cases(),
        distributed_cases(),
        nn_cases(),
    ]
    .into_iter()
    .flatten()
    .collect();
    check_misuse(&cases, KNOWN_BUGS, MIN_CASES);
}

/// `values` as an f32 tensor of `shape` on `backend`.
fn f32s(backend: &BackendRef, values: &[f32], shape: &[usize]) -> Result<Tensor, TensorError> {
    Tensor::from_slice(backend, values, shape)
}

/// An f32 leaf that requires grad.
fn param(backend: &BackendRef, values: &[f32]) -> Result<Tensor, TensorError> {
    let res = f32s(backend, values, &[values.len()])?;
    res.requires_grad_(true)?;
    Ok(res)
}

/// A parameter with a gradient of ones.
fn param_with_grad(backend: &BackendRef, values: &[f32]) -> Result<Tensor, TensorError> {
    let res = param(backend, values)?;
    res.set_grad(Some(Tensor::ones(backend, &[values.len()], DType::F32)?))?;
    Ok(res)
}

/// An f32 optimizer of `R` over one parameter of four elements.
fn one_param_group<R: headroom_optim::UpdateRule>(
    config: R,
    implementation: Implementation,
) -> Result<headroom_optim::GroupOptimizer<R>, OptimError> {
    let cpu = CpuBackend::new_ref();
    let p = param(&cpu, &[1.0; 4])?;
    headroom_optim::GroupOptimizer::new(vec![ParamGroup::new(vec![p], config)], implementation)
}

// ---------------------------------------------------------------------------------------------
// headroom-caching-allocator

fn allocator_cases() -> Vec<Case> {
    fn parse_refused(conf: &str, key: &str) -> Outcome {
        expect_err!(
            AllocatorConfig::parse(conf),
            AllocError::InvalidConfig { key: k, .. } if k == key,
            naming key
        )
    }
    fn simulated(capacity: u64, config: AllocatorConfig) -> CachingAllocator<SimulatedStorage> {
        CachingAllocator::new(SimulatedStorage::new(capacity), config)
    }
    vec![
        Case {
            name: "conf_with_a_misspelt_key_is_invalid_config_naming_it",
            run: || parse_refused("max_split_sise_mb:64", "max_split_sise_mb"),
        },
        Case {
            name: "conf_max_split_size_below_20_mib_is_invalid_config",
            run: || parse_refused("max_split_size_mb:10", "max_split_size_mb"),
        },
        Case {
            name: "conf_expandable_page_size_above_1_tib_is_invalid_config",
            run: || parse_refused("expandable_page_size_mb:1048578", "expandable_page_size_mb"),
        },
        Case {
            name: "conf_fractional_mib_is_invalid_config",
            run: || parse_refused("max_split_size_mb:20.5", "max_split_size_mb"),
        },
        Case {
            name: "conf_key_without_a_value_is_invalid_config",
            run: || parse_refused("expandable_segments:", "expandable_segments"),
        },
        Case {
            name: "conf_item_without_a_colon_is_invalid_config",
            run: || parse_refused("expandable_segments", "expandable_segments"),
        },
        Case {
            name: "conf_cuda_malloc_async_backend_is_invalid_config",
            run: || parse_refused("backend:cudaMallocAsync", "backend"),
        },
        Case {
            name: "conf_roundup_divisions_of_3_is_invalid_config",
            run: || parse_refused("roundup_power2_divisions:3", "roundup_power2_divisions"),
        },
        Case {
            name: "conf_garbage_collection_threshold_of_1_is_invalid_config",
            run: || {
                parse_refused(
                    "garbage_collection_threshold:1.0",
                    "garbage_collection_threshold",
                )
            },
        },
        Case {
            name: "conf_mib_count_overflowing_u64_bytes_is_invalid_config",
            run: || {
                parse_refused(
                    "large_segment_size_mb:18446744073709551615",
                    "large_segment_size_mb",
                )
            },
        },
        Case {
            name: "conf_boolean_that_is_not_true_or_false_is_invalid_config",
            run: || parse_refused("expandable_segments:maybe", "expandable_segments"),
        },
        Case {
            name: "builder_handle_size_above_1_tib_is_invalid_config",
            run: || {
                expect_err!(
                    AllocatorConfig::builder().expandable_handle_size_mb(1_048_578).build(),
                    AllocError::InvalidConfig { key, .. } if key == "expandable_handle_size_mb",
                    naming "expandable_handle_size_mb"
                )
            },
        },
        Case {
            name: "builder_mib_count_overflowing_u64_bytes_is_invalid_config",
            run: || {
                expect_err!(
                    AllocatorConfig::builder().max_split_size_mb(u64::MAX).build(),
                    AllocError::InvalidConfig { key, .. } if key == "max_split_size_mb",
                    naming "too large"
                )
            },
        },
        Case {
            name: "builder_nan_memory_fraction_is_invalid_config",
            run: || {
                expect_err!(
                    AllocatorConfig::builder().per_process_memory_fraction(f64::NAN).build(),
                    AllocError::InvalidConfig { key, .. } if key == "per_process_memory_fraction"
                )
            },
        },
        Case {
            name: "builder_odd_large_segment_size_is_invalid_config",
            run: || {
                expect_err!(
                    AllocatorConfig::builder().large_segment_size_mb(21).build(),
                    AllocError::InvalidConfig { key, .. } if key == "large_segment_size_mb",
                    naming "21 MiB"
                )
            },
        },
        Case {
            name: "allocating_past_a_simulated_device_is_out_of_memory_with_its_report",
            run: || {
                let allocator = simulated(64 << 20, AllocatorConfig::pytorch_defaults());
                let held = allocator.allocate(30 << 20, StreamId::DEFAULT)?;
                let res = expect_err!(
                    allocator.allocate(100 << 20, StreamId::DEFAULT),
                    AllocError::OutOfMemory(report)
                        if report.requested == 100 << 20
                            && report.capacity == 64 << 20
                            && report.allocated == 30 << 20
                            && report.storage == "simulated",
                    naming "tried to allocate 100.00 MiB"
                );
                allocator.free(held)?;
                res
            },
        },
        Case {
            name: "allocating_u64_max_bytes_is_out_of_memory",
            run: || {
                let allocator = simulated(64 << 20, AllocatorConfig::default());
                expect_err!(
                    allocator.allocate(u64::MAX, StreamId::DEFAULT),
                    AllocError::OutOfMemory(report) if report.requested == u64::MAX
                )
            },
        },
        Case {
            name: "allocating_past_the_memory_fraction_is_out_of_memory_naming_the_limit",
            run: || {
                let config = AllocatorConfig::builder()
                    .per_process_memory_fraction(0.5)
                    .expandable_segments(false)
                    .build()?;
                let allocator = simulated(100 << 20, config);
                expect_err!(
                    allocator.allocate(60 << 20, StreamId::DEFAULT),
                    AllocError::OutOfMemory(report) if report.allowed == Some(50 << 20)
                )
            },
        },
        Case {
            name: "allocating_past_a_host_capacity_is_out_of_memory_of_the_host",
            run: || {
                let allocator = CachingAllocator::new(
                    HostStorage::with_capacity(1 << 20),
                    AllocatorConfig::default(),
                );
                expect_err!(
                    allocator.allocate(4 << 20, StreamId::DEFAULT),
                    AllocError::OutOfMemory(report) if report.storage == "host"
                )
            },
        },
        Case {
            name: "freeing_another_allocators_block_is_unknown_address",
            run: || {
                let (ours, theirs) = (
                    simulated(64 << 20, AllocatorConfig::default()),
                    simulated(64 << 20, AllocatorConfig::default()),
                );
                let block = theirs.allocate(4096, StreamId::DEFAULT)?;
                let address = block.address();
                let res = expect_err!(
                    ours.free(block),
                    AllocError::UnknownAddress { address: a } if *a == address
                );
                // The block was refused, not freed: `theirs` still counts it.
                res.and_then(|()| expect_eq(theirs.memory_allocated(), 4096))
            },
        },
        Case {
            name: "record_stream_of_another_allocators_block_is_unknown_address",
            run: || {
                let (ours, theirs) = (
                    simulated(64 << 20, AllocatorConfig::default()),
                    simulated(64 << 20, AllocatorConfig::default()),
                );
                let block = theirs.allocate(4096, StreamId::DEFAULT)?;
                let res = expect_err!(
                    ours.record_stream(&block, StreamId(7)),
                    AllocError::UnknownAddress { .. }
                );
                theirs.free(block)?;
                res
            },
        },
        Case {
            name: "record_stream_at_an_address_never_handed_out_is_unknown_address",
            run: || {
                let allocator = simulated(64 << 20, AllocatorConfig::default());
                expect_err!(
                    allocator.record_stream_address(0x1234, StreamId(1)),
                    AllocError::UnknownAddress { address: 0x1234 },
                    naming "0x1234"
                )
            },
        },
        Case {
            name: "allocation_stream_of_a_freed_block_is_unknown_address",
            run: || {
                let allocator = simulated(64 << 20, AllocatorConfig::default());
                let block = allocator.allocate(512, StreamId(3))?;
                let address = block.address();
                allocator.free(block)?;
                expect_err!(
                    allocator.allocation_stream(address),
                    AllocError::UnknownAddress { .. }
                )
            },
        },
        Case {
            name: "pickle_of_garbage_bytes_is_a_pickle_format_error",
            run: || {
                expect_err!(
                    read_pickle(&b"\x80\x04not a pickle at all"[..]),
                    AllocError::Format {
                        format: "pickle",
                        ..
                    }
                )
            },
        },
        Case {
            name: "json_snapshot_of_garbage_is_a_json_format_error",
            run: || {
                expect_err!(
                    read_json(&b"{\"segments\": 7"[..]),
                    AllocError::Format { format: "json", .. }
                )
            },
        },
        Case {
            name: "trace_tsv_with_an_unknown_action_is_a_trace_format_error",
            run: || {
                expect_err!(
                    read_trace_tsv(&b"action\taddr\tsize\nteleport\t16\t512\n"[..]),
                    AllocError::Format { format: "trace", .. },
                    naming "teleport"
                )
            },
        },
        Case {
            name: "trace_tsv_without_an_action_column_is_a_trace_format_error",
            run: || {
                expect_err!(
                    read_trace_tsv(&b"addr\tsize\n16\t512\n"[..]),
                    AllocError::Format { format: "trace", .. },
                    naming "action"
                )
            },
        },
        Case {
            name: "conf_roundup_list_without_its_closing_bracket_is_invalid_config",
            run: || {
                parse_refused(
                    "roundup_power2_divisions:[256:1,512:2",
                    "roundup_power2_divisions",
                )
            },
        },
        Case {
            name: "conf_roundup_list_with_an_interval_that_is_not_a_power_of_two_is_invalid_config",
            run: || {
                parse_refused(
                    "roundup_power2_divisions:[300:2]",
                    "roundup_power2_divisions",
                )
            },
        },
        Case {
            name: "conf_roundup_list_with_an_interval_past_u64_is_invalid_config",
            run: || {
                parse_refused(
                    "roundup_power2_divisions:[99999999999999999999:2]",
                    "roundup_power2_divisions",
                )
            },
        },
        Case {
            name: "conf_roundup_list_with_an_empty_entry_is_invalid_config",
            run: || parse_refused("roundup_power2_divisions:[:]", "roundup_power2_divisions"),
        },
        Case {
            name: "conf_negative_memory_fraction_is_invalid_config",
            run: || {
                parse_refused(
                    "per_process_memory_fraction:-0.5",
                    "per_process_memory_fraction",
                )
            },
        },
        Case {
            name: "conf_infinite_memory_fraction_is_invalid_config",
            run: || {
                parse_refused(
                    "per_process_memory_fraction:inf",
                    "per_process_memory_fraction",
                )
            },
        },
        Case {
            name: "conf_nan_garbage_collection_threshold_is_invalid_config",
            run: || {
                parse_refused(
                    "garbage_collection_threshold:nan",
                    "garbage_collection_threshold",
                )
            },
        },
        Case {
            name: "conf_later_bad_repeat_of_a_key_is_invalid_config",
            run: || {
                parse_refused(
                    "max_split_size_mb:64,max_split_size_mb:10",
                    "max_split_size_mb",
                )
            },
        },
        Case {
            name: "conf_key_of_non_ascii_text_is_invalid_config_naming_it",
            run: || parse_refused("tamaño_mb:1", "tamaño_mb"),
        },
        Case {
            name: "pickle_nested_past_the_depth_limit_is_a_pickle_format_error",
            run: || {
                let mut bytes = b"\x80\x04".to_vec();
                bytes.extend(std::iter::repeat_n(b']', 600));
                bytes.extend(std::iter::repeat_n(b'a', 599));
                bytes.push(b'.');
                expect_err!(
                    read_pickle(&bytes[..]),
                    AllocError::Format { format: "pickle", .. },
                    naming "deeper"
                )
            },
        },
        Case {
            name: "empty_pickle_is_a_pickle_format_error",
            run: || {
                expect_err!(
                    read_pickle(&b""[..]),
                    AllocError::Format {
                        format: "pickle",
                        ..
                    }
                )
            },
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// headroom-autograd-core (on the CPU backend)

fn autograd_cases() -> Vec<Case> {
    vec![
        Case {
            name: "adding_unbroadcastable_shapes_is_shape_mismatch",
            run: || {
                let cpu = CpuBackend::new_ref();
                let a = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                let b = Tensor::zeros(&cpu, &[4], DType::F32)?;
                expect_err!(a.add(&b), TensorError::ShapeMismatch { op: "add", .. })
            },
        },
        Case {
            name: "matmul_of_mismatched_inner_dims_is_shape_mismatch",
            run: || {
                let cpu = CpuBackend::new_ref();
                let a = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                let b = Tensor::zeros(&cpu, &[4, 5], DType::F32)?;
                expect_err!(
                    a.matmul(&b),
                    TensorError::ShapeMismatch { op: "matmul", .. }
                )
            },
        },
        Case {
            name: "reshape_to_another_element_count_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let a = Tensor::zeros(&cpu, &[6], DType::F32)?;
                expect_err!(
                    a.reshape(&[4]),
                    TensorError::InvalidArgument { op: "reshape", .. },
                    naming "6 elements"
                )
            },
        },
        Case {
            name: "narrow_past_the_end_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let a = Tensor::zeros(&cpu, &[4], DType::F32)?;
                expect_err!(
                    a.narrow(0, 2, 5),
                    TensorError::InvalidArgument { op: "narrow", .. }
                )
            },
        },
        Case {
            name: "narrow_with_a_start_near_usize_max_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let a = Tensor::zeros(&cpu, &[4], DType::F32)?;
                expect_err!(
                    a.narrow(0, usize::MAX, 2),
                    TensorError::InvalidArgument { op: "narrow", .. }
                )
            },
        },
        Case {
            name: "transpose_of_a_dim_out_of_range_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let a = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                expect_err!(
                    a.transpose(0, 5),
                    TensorError::InvalidArgument { op: "transpose", .. },
                    naming "dim 5"
                )
            },
        },
        Case {
            name: "expand_to_an_incompatible_shape_is_shape_mismatch",
            run: || {
                let cpu = CpuBackend::new_ref();
                let a = Tensor::zeros(&cpu, &[3], DType::F32)?;
                expect_err!(
                    a.expand(&[2, 4]),
                    TensorError::ShapeMismatch { op: "expand", .. }
                )
            },
        },
        Case {
            name: "as_strided_past_the_buffer_is_invalid_argument",
            run: || {
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
        },
        Case {
            name: "softmax_over_a_dim_out_of_range_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let a = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                expect_err!(
                    a.softmax(2),
                    TensorError::InvalidArgument { op: "softmax", .. }
                )
            },
        },
        Case {
            name: "cat_of_mismatched_shapes_is_shape_mismatch",
            run: || {
                let cpu = CpuBackend::new_ref();
                let a = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                let b = Tensor::zeros(&cpu, &[2, 4], DType::F32)?;
                expect_err!(
                    cat(&[&a, &b], 0),
                    TensorError::ShapeMismatch { op: "cat", .. }
                )
            },
        },
        Case {
            name: "adding_f32_to_f64_is_dtype_mismatch",
            run: || {
                let cpu = CpuBackend::new_ref();
                let a = Tensor::zeros(&cpu, &[2], DType::F32)?;
                let b = Tensor::zeros(&cpu, &[2], DType::F64)?;
                expect_err!(a.add(&b), TensorError::DtypeMismatch { op: "add", .. })
            },
        },
        Case {
            name: "from_slice_with_too_few_elements_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                expect_err!(
                    Tensor::from_slice(&cpu, &[1.0f32, 2.0, 3.0], &[2, 2]),
                    TensorError::InvalidArgument {
                        op: "from_slice",
                        ..
                    }
                )
            },
        },
        Case {
            name: "a_shape_too_large_to_count_is_size_overflow",
            run: || {
                let cpu = CpuBackend::new_ref();
                expect_err!(
                    Tensor::zeros(&cpu, &[usize::MAX, 2], DType::F32),
                    TensorError::SizeOverflow { .. }
                )
            },
        },
        Case {
            name: "a_tensor_past_its_backends_memory_is_alloc_out_of_memory",
            run: || {
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
        },
        Case {
            name: "backward_of_a_non_scalar_without_a_gradient_is_autograd_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = param(&cpu, &[1.0, 2.0])?;
                expect_err!(
                    x.exp()?.backward(),
                    TensorError::Autograd { op: "backward", .. },
                    naming "one-element"
                )
            },
        },
        Case {
            name: "backward_with_a_gradient_of_another_shape_is_shape_mismatch",
            run: || {
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
        },
        Case {
            name: "backward_of_a_tensor_that_does_not_require_grad_is_autograd_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = f32s(&cpu, &[1.0, 2.0], &[2])?;
                expect_err!(x.sum_all()?.backward(), TensorError::Autograd { .. })
            },
        },
        Case {
            name: "writing_a_saved_tensor_in_place_then_backward_is_modified_in_place",
            run: || {
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
        },
        Case {
            name: "backward_twice_without_retain_graph_is_graph_freed",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = param(&cpu, &[0.5, 1.0])?;
                let loss = x.exp()?.sum_all()?;
                loss.backward()?;
                expect_err!(loss.backward(), TensorError::GraphFreed { .. })
            },
        },
        Case {
            name: "in_place_write_to_a_leaf_that_requires_grad_is_autograd_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = param(&cpu, &[0.5, 1.0])?;
                expect_err!(x.fill_(0.0), TensorError::Autograd { op: "fill_", .. })
            },
        },
        Case {
            name: "requires_grad_on_an_integer_tensor_is_unsupported_dtype",
            run: || {
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
        },
        Case {
            name: "requires_grad_on_a_non_leaf_is_autograd_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let y = param(&cpu, &[1.0])?.exp()?;
                expect_err!(
                    y.requires_grad_(false),
                    TensorError::Autograd {
                        op: "requires_grad_",
                        ..
                    }
                )
            },
        },
        Case {
            name: "set_grad_of_another_shape_is_shape_mismatch",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = param(&cpu, &[1.0, 2.0])?;
                expect_err!(
                    x.set_grad(Some(Tensor::ones(&cpu, &[3], DType::F32)?)),
                    TensorError::ShapeMismatch { op: "set_grad", .. }
                )
            },
        },
        Case {
            name: "an_op_writing_a_buffer_claimed_by_a_reader_is_concurrent_access",
            run: || {
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
        },
        Case {
            name: "an_op_reading_a_buffer_claimed_by_a_writer_is_concurrent_access",
            run: || {
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
        },
        Case {
            name: "tensors_of_two_backends_in_one_op_is_invalid_argument",
            run: || {
                let (one, other) = (CpuBackend::new_ref(), CpuBackend::new_ref());
                let a = Tensor::ones(&one, &[2], DType::F32)?;
                let b = Tensor::ones(&other, &[2], DType::F32)?;
                expect_err!(
                    a.add(&b),
                    TensorError::InvalidArgument { op: "binary", .. },
                    naming "another backend"
                )
            },
        },
        Case {
            name: "writing_into_an_expanded_view_is_overlap",
            run: || {
                let cpu = CpuBackend::new_ref();
                let a = Tensor::zeros(&cpu, &[1], DType::F32)?.expand(&[4])?;
                expect_err!(a.fill_(1.0), TensorError::Overlap { op: "fill_", .. })
            },
        },
        Case {
            name: "dropout_with_probability_above_1_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::ones(&cpu, &[4], DType::F32)?;
                expect_err!(
                    dropout(&x, 1.5, true, &Generator::new(0)),
                    TensorError::InvalidArgument { op: "dropout", .. }
                )
            },
        },
        Case {
            name: "cross_entropy_with_a_target_past_the_classes_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let logits = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                let target = Tensor::from_slice(&cpu, &[0i64, 7], &[2])?;
                expect_err!(
                    cross_entropy(&logits, &target, -100, Reduction::Mean),
                    TensorError::InvalidArgument { op: "cross_entropy", .. },
                    naming "target 7"
                )
            },
        },
        Case {
            name: "gather_with_an_index_out_of_range_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                let index = Tensor::from_slice(&cpu, &[0i64, 3], &[2, 1])?;
                expect_err!(
                    x.gather(1, &index),
                    TensorError::InvalidArgument { op: "gather", .. },
                    naming "index 3"
                )
            },
        },
        Case {
            name: "split_into_pieces_of_0_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[4], DType::F32)?;
                expect_err!(
                    x.split(0, 0),
                    TensorError::InvalidArgument { op: "split", .. }
                )
            },
        },
        Case {
            name: "split_with_sizes_that_miss_the_dim_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[4], DType::F32)?;
                expect_err!(
                    x.split_with_sizes(&[1, 1], 0),
                    TensorError::InvalidArgument { op: "split", .. }
                )
            },
        },
        Case {
            name: "permute_with_a_repeated_dim_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                expect_err!(
                    x.permute(&[0, 0]),
                    TensorError::InvalidArgument { op: "permute", .. }
                )
            },
        },
        Case {
            // PyTorch raises "dim 0 appears multiple times"; Headroom reduces the dim once.
            name: "sum_over_a_repeated_dim_reduces_it_once",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = f32s(&cpu, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
                expect_eq(x.sum(&[0, 0], false)?.to_vec::<f32>()?, vec![5.0, 7.0, 9.0])
            },
        },
        Case {
            name: "max_over_an_empty_dim_is_shape_mismatch",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[0, 3], DType::F32)?;
                expect_err!(x.max_dim(0, false), TensorError::ShapeMismatch { .. })
            },
        },
        Case {
            name: "reshape_inferred_with_two_unknowns_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[6], DType::F32)?;
                expect_err!(
                    x.reshape_inferred(&[-1, -1]),
                    TensorError::InvalidArgument { op: "reshape", .. }
                )
            },
        },
        Case {
            name: "reshape_inferred_beside_a_zero_dim_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[6], DType::F32)?;
                expect_err!(
                    x.reshape_inferred(&[0, -1]),
                    TensorError::InvalidArgument { op: "reshape", .. }
                )
            },
        },
        Case {
            name: "reshape_inferred_with_a_negative_size_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[6], DType::F32)?;
                expect_err!(
                    x.reshape_inferred(&[-2, -3]),
                    TensorError::InvalidArgument { op: "reshape", .. }
                )
            },
        },
        Case {
            name: "as_strided_with_an_overflowing_stride_is_size_overflow",
            run: || {
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
        },
        Case {
            name: "expand_to_more_elements_than_usize_counts_is_size_overflow",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[1, 3], DType::F32)?;
                expect_err!(
                    x.expand(&[usize::MAX, 3]),
                    TensorError::SizeOverflow { op: "expand", .. }
                )
            },
        },
        Case {
            name: "cat_of_no_tensors_is_invalid_argument",
            run: || expect_err!(cat(&[], 0), TensorError::InvalidArgument { op: "cat", .. }),
        },
        Case {
            name: "cat_along_a_dim_out_of_range_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let a = Tensor::zeros(&cpu, &[2], DType::F32)?;
                expect_err!(
                    cat(&[&a, &a], 3),
                    TensorError::InvalidArgument { op: "cat", .. }
                )
            },
        },
        Case {
            name: "flatten_with_start_after_end_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[2, 3, 4], DType::F32)?;
                expect_err!(
                    x.flatten(2, 0),
                    TensorError::InvalidArgument { op: "flatten", .. }
                )
            },
        },
        Case {
            name: "unsqueeze_past_the_last_position_is_invalid_argument",
            run: || {
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
        },
        Case {
            name: "matmul_of_a_scalar_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let s = Tensor::scalar(&cpu, 2.0, DType::F32)?;
                let m = Tensor::ones(&cpu, &[2, 2], DType::F32)?;
                expect_err!(
                    s.matmul(&m),
                    TensorError::InvalidArgument { op: "matmul", .. }
                )
            },
        },
        Case {
            name: "masked_fill_with_a_float_mask_is_unsupported_dtype",
            run: || {
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
        },
        Case {
            name: "layer_norm_with_a_weight_of_another_shape_is_shape_mismatch",
            run: || {
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
        },
        Case {
            name: "layer_norm_over_a_shape_the_input_does_not_end_with_is_shape_mismatch",
            run: || {
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
        },
        Case {
            name: "attention_of_mismatched_key_and_query_widths_is_shape_mismatch",
            run: || {
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
        },
        Case {
            name: "patch_embedding_with_patches_of_0_is_shape_mismatch",
            run: || {
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
        },
        Case {
            name: "embedding_of_a_one_dimensional_weight_is_invalid_argument",
            run: || {
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
        },
        Case {
            name: "to_vec_of_another_element_type_converts_each_value",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = f32s(&cpu, &[1.5, -2.0], &[2])?;
                expect_eq(x.to_vec::<f64>()?, vec![1.5, -2.0])
            },
        },
        Case {
            name: "item_of_two_elements_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::ones(&cpu, &[2], DType::F32)?;
                expect_err!(x.item(), TensorError::InvalidArgument { op: "item", .. })
            },
        },
        Case {
            name: "set_grad_of_another_dtype_is_dtype_mismatch",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = param(&cpu, &[1.0, 2.0])?;
                expect_err!(
                    x.set_grad(Some(Tensor::ones(&cpu, &[2], DType::F64)?)),
                    TensorError::DtypeMismatch { op: "set_grad", .. }
                )
            },
        },
        Case {
            name: "register_hook_on_a_tensor_without_grad_is_autograd_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::ones(&cpu, &[2], DType::F32)?;
                expect_err!(
                    x.register_hook(|_| Ok(None)),
                    TensorError::Autograd {
                        op: "register_hook",
                        ..
                    }
                )
            },
        },
        Case {
            name: "cross_entropy_with_targets_of_another_count_is_shape_mismatch",
            run: || {
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
        },
        Case {
            name: "cross_entropy_with_float_targets_is_dtype_mismatch",
            run: || {
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
        },
        Case {
            name: "flatten_to_a_dim_out_of_range_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[2, 3, 4], DType::F32)?;
                expect_err!(
                    x.flatten(0, 5),
                    TensorError::InvalidArgument { op: "flatten", .. }
                )
            },
        },
        Case {
            name: "squeeze_of_a_dim_out_of_range_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[2, 1], DType::F32)?;
                expect_err!(
                    x.squeeze_dim(5),
                    TensorError::InvalidArgument { op: "squeeze", .. }
                )
            },
        },
        Case {
            name: "narrow_of_a_dim_out_of_range_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                expect_err!(
                    x.narrow(-3, 0, 1),
                    TensorError::InvalidArgument { op: "narrow", .. }
                )
            },
        },
        Case {
            name: "split_along_a_dim_out_of_range_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                expect_err!(
                    x.split(1, 2),
                    TensorError::InvalidArgument { op: "split", .. }
                )
            },
        },
        Case {
            name: "sum_over_a_dim_out_of_range_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                expect_err!(
                    x.sum(&[2], true),
                    TensorError::InvalidArgument { op: "sum", .. }
                )
            },
        },
        Case {
            name: "max_over_a_dim_out_of_range_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                expect_err!(
                    x.max_dim(-3, false),
                    TensorError::InvalidArgument { op: "max", .. }
                )
            },
        },
        Case {
            name: "permute_with_too_few_dims_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                expect_err!(
                    x.permute(&[0]),
                    TensorError::InvalidArgument { op: "permute", .. }
                )
            },
        },
        Case {
            name: "permute_with_a_dim_out_of_range_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                expect_err!(
                    x.permute(&[0, 5]),
                    TensorError::InvalidArgument { op: "permute", .. }
                )
            },
        },
        Case {
            name: "gather_along_a_dim_out_of_range_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = Tensor::zeros(&cpu, &[2, 3], DType::F32)?;
                let index = Tensor::from_slice(&cpu, &[0i64, 1], &[2, 1])?;
                expect_err!(
                    x.gather(4, &index),
                    TensorError::InvalidArgument { op: "gather", .. }
                )
            },
        },
        Case {
            name: "log_softmax_of_a_scalar_along_dim_1_is_invalid_argument",
            run: || {
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
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// headroom-optim

fn optim_cases() -> Vec<Case> {
    /// `config` refused by the optimizer's constructor, the error naming `op` (its config type).
    fn refused<R: headroom_optim::UpdateRule>(
        config: R,
        implementation: Implementation,
        op: &str,
    ) -> Outcome {
        expect_err!(
            one_param_group(config, implementation),
            OptimError::InvalidArgument { op: o, .. } if *o == op
        )
    }
    /// A scheduler over a fresh SGD optimizer of one parameter.
    fn scheduler(schedule: Schedule) -> Result<LrScheduler, OptimError> {
        let mut sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
        LrScheduler::new(schedule, &mut sgd)
    }
    vec![
        Case {
            name: "sgd_with_negative_lr_is_invalid_argument",
            run: || refused(SgdConfig::new(-0.1), Implementation::Fused, "SgdConfig"),
        },
        Case {
            name: "sgd_with_nan_momentum_is_invalid_argument",
            run: || {
                refused(
                    SgdConfig {
                        momentum: f64::NAN,
                        ..SgdConfig::new(0.1)
                    },
                    Implementation::Single,
                    "SgdConfig",
                )
            },
        },
        Case {
            name: "sgd_nesterov_without_momentum_is_invalid_argument",
            run: || {
                refused(
                    SgdConfig {
                        nesterov: true,
                        ..SgdConfig::new(0.1)
                    },
                    Implementation::FOREACH,
                    "SgdConfig",
                )
            },
        },
        Case {
            name: "adam_with_negative_lr_is_invalid_argument",
            run: || {
                refused(
                    AdamConfig {
                        lr: -1e-3,
                        ..AdamConfig::adam()
                    },
                    Implementation::Fused,
                    "AdamConfig",
                )
            },
        },
        Case {
            name: "adam_with_beta2_of_1_is_invalid_argument",
            run: || {
                refused(
                    AdamConfig {
                        betas: (0.9, 1.0),
                        ..AdamConfig::adamw()
                    },
                    Implementation::Fused,
                    "AdamConfig",
                )
            },
        },
        Case {
            name: "adam_with_nan_eps_is_invalid_argument",
            run: || {
                refused(
                    AdamConfig {
                        eps: f64::NAN,
                        ..AdamConfig::adam()
                    },
                    Implementation::ForeachUnbounded,
                    "AdamConfig",
                )
            },
        },
        Case {
            name: "adam_with_negative_weight_decay_is_invalid_argument",
            run: || {
                refused(
                    AdamConfig {
                        weight_decay: -0.1,
                        ..AdamConfig::adamw()
                    },
                    Implementation::Single,
                    "AdamConfig",
                )
            },
        },
        Case {
            name: "adafactor_with_positive_beta2_decay_is_invalid_argument",
            run: || {
                refused(
                    AdafactorConfig {
                        beta2_decay: 0.8,
                        ..AdafactorConfig::new()
                    },
                    Implementation::Fused,
                    "AdafactorConfig",
                )
            },
        },
        Case {
            name: "adafactor_with_d_below_1_is_invalid_argument",
            run: || {
                refused(
                    AdafactorConfig {
                        d: 0.5,
                        ..AdafactorConfig::new()
                    },
                    Implementation::Single,
                    "AdafactorConfig",
                )
            },
        },
        Case {
            name: "adafactor_with_negative_weight_decay_is_invalid_argument",
            run: || {
                refused(
                    AdafactorConfig {
                        weight_decay: -0.1,
                        ..AdafactorConfig::new()
                    },
                    Implementation::Fused,
                    "AdafactorConfig",
                )
            },
        },
        Case {
            name: "adafactor_with_negative_eps_is_invalid_argument",
            run: || {
                refused(
                    AdafactorConfig {
                        eps: (Some(-1e-30), -1e-3),
                        ..AdafactorConfig::new()
                    },
                    Implementation::Fused,
                    "AdafactorConfig",
                )
            },
        },
        Case {
            name: "adam8bit_with_beta1_above_1_is_invalid_argument",
            run: || {
                refused(
                    Adam8bitConfig {
                        betas: (1.5, 0.999),
                        ..Adam8bitConfig::adam()
                    },
                    Implementation::Fused,
                    "Adam8bitConfig",
                )
            },
        },
        Case {
            name: "adam8bit_with_negative_eps_is_invalid_argument",
            run: || {
                refused(
                    Adam8bitConfig {
                        eps: -1e-8,
                        ..Adam8bitConfig::adamw()
                    },
                    Implementation::Fused,
                    "Adam8bitConfig",
                )
            },
        },
        Case {
            name: "adam8bit_single_is_unsupported",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0; 4])?;
                expect_err!(
                    Adam8bit::new(
                        vec![ParamGroup::new(vec![p], Adam8bitConfig::adam())],
                        Implementation::Single
                    ),
                    OptimError::Unsupported { .. }
                )
            },
        },
        Case {
            name: "adam_on_an_integer_parameter_is_dtype_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = Tensor::from_slice(&cpu, &[1i64, 2], &[2])?;
                expect_err!(
                    Adam::new(
                        vec![ParamGroup::new(vec![p], AdamConfig::adam())],
                        Implementation::Fused
                    ),
                    OptimError::DType {
                        got: DType::I64,
                        ..
                    }
                )
            },
        },
        Case {
            name: "adafactor_on_a_bf16_parameter_is_dtype_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = Tensor::ones(&cpu, &[2, 2], DType::BF16)?;
                expect_err!(
                    Adafactor::new(
                        vec![ParamGroup::new(vec![p], AdafactorConfig::new())],
                        Implementation::Fused
                    ),
                    OptimError::DType {
                        got: DType::BF16,
                        ..
                    }
                )
            },
        },
        Case {
            name: "adam_stochastic_on_an_f32_parameter_is_dtype_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0; 4])?;
                let config = AdamStochasticConfig::new(AdamConfig::adam(), 0);
                expect_err!(
                    AdamStochastic::new(
                        vec![ParamGroup::new(vec![p], config)],
                        Implementation::Fused
                    ),
                    OptimError::DType {
                        got: DType::F32,
                        ..
                    }
                )
            },
        },
        Case {
            name: "sgd_on_a_non_contiguous_parameter_is_non_contiguous",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = Tensor::zeros(&cpu, &[2, 3], DType::F32)?.t()?;
                expect_err!(
                    Sgd::new(
                        vec![ParamGroup::new(vec![p], SgdConfig::new(0.1))],
                        Implementation::Fused
                    ),
                    OptimError::NonContiguous { shape, .. } if shape == &[3, 2]
                )
            },
        },
        Case {
            name: "sgd_with_one_parameter_listed_twice_is_unsupported_tensor",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0; 4])?;
                expect_err!(
                    Sgd::new(
                        vec![ParamGroup::new(vec![p.clone(), p], SgdConfig::new(0.1))],
                        Implementation::Fused
                    ),
                    OptimError::UnsupportedTensor { op: "SGD", .. }
                )
            },
        },
        Case {
            name: "sgd_over_two_views_of_one_storage_is_unsupported_tensor",
            run: || {
                let cpu = CpuBackend::new_ref();
                let whole = Tensor::zeros(&cpu, &[8], DType::F32)?;
                let (a, b) = (whole.narrow(0, 0, 5)?, whole.narrow(0, 3, 5)?);
                expect_err!(
                    Sgd::new(
                        vec![ParamGroup::new(vec![a, b], SgdConfig::new(0.1))],
                        Implementation::Fused
                    ),
                    OptimError::UnsupportedTensor { op: "SGD", .. }
                )
            },
        },
        Case {
            name: "stepping_one_parameter_twice_in_a_call_is_invalid_argument",
            run: || {
                let mut sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
                let (id, p) = sgd.params().remove(0);
                p.set_grad(Some(Tensor::ones(p.backend(), &[4], DType::F32)?))?;
                let res = expect_err!(
                    sgd.step_with(StepParams::Only(&[id, id]), Scaling::None),
                    OptimError::InvalidArgument { .. }
                );
                // Refused before any update.
                res.and_then(|()| expect_eq(p.to_vec::<f32>()?, vec![1.0; 4]))
            },
        },
        Case {
            name: "stepping_a_handle_of_another_optimizer_is_unknown_parameter",
            run: || {
                let cpu = CpuBackend::new_ref();
                let params: Vec<Tensor> = (0..3)
                    .map(|_| param(&cpu, &[1.0; 2]))
                    .collect::<Result<_, _>>()?;
                let big = Sgd::new(
                    vec![ParamGroup::new(params, SgdConfig::new(0.1))],
                    Implementation::Fused,
                )?;
                let foreign = big.params()[2].0;
                let mut small = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
                expect_err!(
                    small.step_with(StepParams::Only(&[foreign]), Scaling::None),
                    OptimError::UnknownParameter { .. }
                )
            },
        },
        Case {
            name: "param_id_of_a_tensor_outside_the_optimizer_is_unknown_parameter",
            run: || {
                let sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
                let cpu = CpuBackend::new_ref();
                expect_err!(
                    sgd.param_id(&param(&cpu, &[1.0; 4])?),
                    OptimError::UnknownParameter { .. }
                )
            },
        },
        Case {
            name: "a_gradient_scale_for_a_foreach_step_is_unsupported",
            run: || {
                let mut adam = one_param_group(AdamConfig::adam(), Implementation::FOREACH)?;
                let scaling = GradScaling {
                    grad_scale: Some(1024.0),
                    found_inf: Some(0.0),
                };
                expect_err!(
                    adam.step_with(StepParams::All, Scaling::Host(scaling)),
                    OptimError::Unsupported { .. }
                )
            },
        },
        Case {
            name: "state_dict_of_garbage_bytes_is_a_safetensors_error",
            run: || {
                let mut adam = one_param_group(AdamConfig::adam(), Implementation::Fused)?;
                expect_err!(
                    adam.load_state_dict(b"definitely not safetensors"),
                    OptimError::SafeTensors(_)
                )
            },
        },
        Case {
            name: "state_dict_of_another_models_shapes_is_state_dict_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param_with_grad(&cpu, &[1.0; 3])?;
                let mut three = Adam::new(
                    vec![ParamGroup::new(vec![p], AdamConfig::adam())],
                    Implementation::Fused,
                )?;
                three.step()?;
                let saved = three.state_dict()?;
                let mut four = one_param_group(AdamConfig::adam(), Implementation::Fused)?;
                expect_err!(four.load_state_dict(&saved), OptimError::StateDict(_))
            },
        },
        Case {
            name: "state_dict_of_sgd_into_adam_is_state_dict_error",
            run: || {
                let mut sgd = one_param_group(
                    SgdConfig {
                        momentum: 0.9,
                        ..SgdConfig::new(0.1)
                    },
                    Implementation::Fused,
                )?;
                let (_, p) = sgd.params().remove(0);
                p.set_grad(Some(Tensor::ones(p.backend(), &[4], DType::F32)?))?;
                sgd.step()?;
                let saved = sgd.state_dict()?;
                let mut adam = one_param_group(AdamConfig::adam(), Implementation::Fused)?;
                expect_err!(adam.load_state_dict(&saved), OptimError::StateDict(_))
            },
        },
        Case {
            name: "clip_grad_norm_with_nan_max_norm_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param_with_grad(&cpu, &[1.0; 4])?;
                expect_err!(
                    clip_grad_norm_(&[p], f64::NAN, NormType::L2, false),
                    OptimError::InvalidArgument {
                        op: "clip_grad_norm_",
                        ..
                    }
                )
            },
        },
        Case {
            name: "clip_grad_norm_with_negative_max_norm_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param_with_grad(&cpu, &[1.0; 4])?;
                let res = expect_err!(
                    clip_grad_norm_(std::slice::from_ref(&p), -1.0, NormType::L2, false),
                    OptimError::InvalidArgument {
                        op: "clip_grad_norm_",
                        ..
                    }
                );
                // Whatever it answers, the gradients must not have changed sign.
                let grad = p.grad().ok_or("the gradient is gone")?.to_vec::<f32>()?;
                res.and_then(|()| expect_eq(grad, vec![1.0; 4]))
            },
        },
        Case {
            name: "clip_grad_norm_of_no_parameters_is_invalid_argument",
            run: || {
                expect_err!(
                    clip_grad_norm_(&[], 1.0, NormType::Inf, false),
                    OptimError::InvalidArgument {
                        op: "clip_grad_norm_",
                        ..
                    }
                )
            },
        },
        Case {
            name: "clip_grad_norm_of_an_infinite_gradient_with_error_if_nonfinite_changes_nothing",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0, 1.0])?;
                p.set_grad(Some(f32s(&cpu, &[f32::INFINITY, 3.0], &[2])?))?;
                let res = expect_err!(
                    clip_grad_norm_(std::slice::from_ref(&p), 1.0, NormType::L2, true),
                    OptimError::NonFiniteNorm {
                        norm_type: NormType::L2,
                        ..
                    }
                );
                let grad = p.grad().ok_or("the gradient is gone")?.to_vec::<f32>()?;
                res.and_then(|()| expect_eq(grad, vec![f32::INFINITY, 3.0]))
            },
        },
        Case {
            name: "clip_grad_value_with_a_negative_bound_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param_with_grad(&cpu, &[1.0; 4])?;
                expect_err!(
                    clip_grad_value_(&[p], -0.5),
                    OptimError::InvalidArgument {
                        op: "clip_grad_value_",
                        ..
                    }
                )
            },
        },
        Case {
            name: "clip_grad_norm_of_f64_gradients_is_dtype_error",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = Tensor::ones(&cpu, &[2], DType::F64)?;
                p.requires_grad_(true)?;
                p.set_grad(Some(Tensor::ones(&cpu, &[2], DType::F64)?))?;
                expect_err!(
                    clip_grad_norm_(&[p], 1.0, NormType::L2, false),
                    OptimError::DType {
                        got: DType::F64,
                        ..
                    }
                )
            },
        },
        Case {
            name: "one_cycle_schedule_of_one_step_is_invalid_argument",
            run: || {
                expect_err!(
                    scheduler(Schedule::one_cycle(0.1, 1)),
                    OptimError::InvalidArgument {
                        op: "LrScheduler",
                        ..
                    }
                )
            },
        },
        Case {
            name: "one_cycle_schedule_with_pct_start_above_1_is_invalid_argument",
            run: || {
                expect_err!(
                    scheduler(Schedule::OneCycle {
                        max_lr: 0.1,
                        total_steps: 100,
                        pct_start: 1.5,
                        div_factor: 25.0,
                        final_div_factor: 1e4,
                    }),
                    OptimError::InvalidArgument {
                        op: "LrScheduler",
                        ..
                    }
                )
            },
        },
        Case {
            name: "one_cycle_schedule_with_div_factor_0_is_invalid_argument",
            run: || {
                expect_err!(
                    scheduler(Schedule::OneCycle {
                        max_lr: 0.1,
                        total_steps: 100,
                        pct_start: 0.3,
                        div_factor: 0.0,
                        final_div_factor: 1e4,
                    }),
                    OptimError::InvalidArgument {
                        op: "LrScheduler",
                        ..
                    }
                )
            },
        },
        Case {
            name: "linear_warmup_with_negative_start_factor_is_invalid_argument",
            run: || {
                expect_err!(
                    scheduler(Schedule::LinearWarmup {
                        start_factor: -1.0,
                        warmup_steps: 10
                    }),
                    OptimError::InvalidArgument {
                        op: "LrScheduler",
                        ..
                    }
                )
            },
        },
        Case {
            name: "adam_kernel_with_a_short_gradient_is_length_mismatch",
            run: || {
                let (mut param, grad) = (vec![1.0f32; 4], vec![0.5f32; 3]);
                let (mut exp_avg, mut exp_avg_sq) = (vec![0.0; 4], vec![0.0; 4]);
                let buffers = AdamBuffers {
                    param: &mut param,
                    grad: &grad,
                    exp_avg: &mut exp_avg,
                    exp_avg_sq: &mut exp_avg_sq,
                    max_exp_avg_sq: None,
                };
                let res = expect_err!(
                    adam_fused(&AdamConfig::adam(), 1, buffers, GradScaling::NONE),
                    OptimError::LengthMismatch {
                        expected: 4,
                        got: 3,
                        ..
                    }
                );
                res.and_then(|()| expect_eq(param, vec![1.0; 4]))
            },
        },
        Case {
            name: "adam_kernel_at_step_0_is_invalid_argument",
            run: || {
                let (mut param, grad) = (vec![1.0f32; 4], vec![0.5f32; 4]);
                let (mut exp_avg, mut exp_avg_sq) = (vec![0.0; 4], vec![0.0; 4]);
                let buffers = AdamBuffers {
                    param: &mut param,
                    grad: &grad,
                    exp_avg: &mut exp_avg,
                    exp_avg_sq: &mut exp_avg_sq,
                    max_exp_avg_sq: None,
                };
                // Step 0 divides by 1 - beta^0 = 0: every parameter would become NaN.
                let res = expect_err!(
                    adam_fused(&AdamConfig::adam(), 0, buffers, GradScaling::NONE),
                    OptimError::InvalidArgument { .. }
                );
                res.and_then(|()| expect_eq(param, vec![1.0; 4]))
            },
        },
        Case {
            name: "adam8bit_kernel_with_a_short_absmax_is_length_mismatch",
            run: || {
                let n = 600;
                let (qmap1, qmap2) = (dynamic_map(true), dynamic_map(false));
                let (mut param, grad) = (vec![0.1f32; n], vec![0.5f32; n]);
                let (mut state1, mut state2) = (vec![0u8; n], vec![0u8; n]);
                let mut absmax1 = vec![0.0f32; n_blocks(n) - 1];
                let mut absmax2 = vec![0.0f32; n_blocks(n)];
                let buffers = Adam8bitBuffers {
                    param: &mut param,
                    grad: &grad,
                    state1: &mut state1,
                    state2: &mut state2,
                    absmax1: &mut absmax1,
                    absmax2: &mut absmax2,
                };
                expect_err!(
                    adam8bit_blockwise(
                        &Adam8bitConfig::adam(),
                        1,
                        &qmap1,
                        &qmap2,
                        buffers,
                        GradScaling::NONE
                    ),
                    OptimError::LengthMismatch { .. }
                )
            },
        },
        Case {
            name: "param_step_of_an_index_past_its_group_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let (a, b) = (
                    param_with_grad(&cpu, &[1.0; 2])?,
                    param_with_grad(&cpu, &[1.0; 2])?,
                );
                let mut sgd = Sgd::new(
                    vec![
                        ParamGroup::new(vec![a], SgdConfig::new(0.1)),
                        ParamGroup::new(vec![b], SgdConfig::new(0.1)),
                    ],
                    Implementation::Fused,
                )?;
                sgd.step()?;
                // Group 0 has one parameter: index 1 is not one of its parameters.
                expect_err!(sgd.param_step(0, 1), OptimError::InvalidArgument { .. })
            },
        },
        Case {
            name: "param_step_of_a_group_out_of_range_is_invalid_argument",
            run: || {
                let sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
                expect_err!(sgd.param_step(3, 0), OptimError::InvalidArgument { .. })
            },
        },
        Case {
            name: "adam8bit_kernel_at_step_0_is_invalid_argument",
            run: || {
                let n = 8;
                let (qmap1, qmap2) = (dynamic_map(true), dynamic_map(false));
                let (mut param, grad) = (vec![0.1f32; n], vec![0.5f32; n]);
                let (mut state1, mut state2) = (vec![0u8; n], vec![0u8; n]);
                let (mut absmax1, mut absmax2) = (vec![0.0f32; 1], vec![0.0f32; 1]);
                let buffers = Adam8bitBuffers {
                    param: &mut param,
                    grad: &grad,
                    state1: &mut state1,
                    state2: &mut state2,
                    absmax1: &mut absmax1,
                    absmax2: &mut absmax2,
                };
                let res = expect_err!(
                    adam8bit_blockwise(
                        &Adam8bitConfig::adam(),
                        0,
                        &qmap1,
                        &qmap2,
                        buffers,
                        GradScaling::NONE
                    ),
                    OptimError::InvalidArgument { .. }
                );
                res.and_then(|()| expect_eq(param, vec![0.1; n]))
            },
        },
        Case {
            name: "grad_scaling_by_0_in_a_fused_step_is_invalid_argument",
            run: || {
                let mut adam = one_param_group(AdamConfig::adam(), Implementation::Fused)?;
                let (_, p) = adam.params().remove(0);
                p.set_grad(Some(Tensor::ones(p.backend(), &[4], DType::F32)?))?;
                let scaling = GradScaling {
                    grad_scale: Some(0.0),
                    found_inf: Some(0.0),
                };
                let res = expect_err!(
                    adam.step_with(StepParams::All, Scaling::Host(scaling)),
                    OptimError::InvalidArgument { .. }
                );
                res.and_then(|()| expect_eq(p.to_vec::<f32>()?, vec![1.0; 4]))
            },
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// headroom-amp

fn amp_cases() -> Vec<Case> {
    /// A GradScaler and SGD (fused) of one parameter `p`, a scaled loss backwarded.
    #[allow(clippy::type_complexity)]
    fn scaled() -> Result<(GradScaler, Sgd, Tensor), Box<dyn Error + Send + Sync>> {
        let cpu = CpuBackend::new_ref();
        let p = param(&cpu, &[1.0; 4])?;
        let sgd = Sgd::new(
            vec![ParamGroup::new(vec![p.clone()], SgdConfig::new(0.1))],
            Implementation::Fused,
        )?;
        let mut scaler = GradScaler::new(GradScalerConfig::default())?;
        scaler.scale(&p.sum_all()?)?.backward()?;
        Ok((scaler, sgd, p))
    }
    /// A scaler and SGD in the single form (no device scaling: `unscale_` then `step`).
    fn scaled_single() -> Result<(GradScaler, Sgd), Box<dyn Error + Send + Sync>> {
        let cpu = CpuBackend::new_ref();
        let p = param(&cpu, &[1.0; 4])?;
        let sgd = Sgd::new(
            vec![ParamGroup::new(vec![p.clone()], SgdConfig::new(0.1))],
            Implementation::Single,
        )?;
        let mut scaler = GradScaler::new(GradScalerConfig::default())?;
        scaler.scale(&p.sum_all()?)?.backward()?;
        Ok((scaler, sgd))
    }
    fn config_refused(config: GradScalerConfig) -> Outcome {
        expect_err!(
            GradScaler::new(config),
            AmpError::InvalidScalerConfig { .. }
        )
    }
    fn init_scale_refused(init_scale: f64) -> Outcome {
        config_refused(GradScalerConfig {
            init_scale,
            ..GradScalerConfig::default()
        })
    }
    vec![
        Case {
            name: "grad_scaler_with_init_scale_1e_50_is_invalid_scaler_config",
            run: || init_scale_refused(1e-50),
        },
        Case {
            name: "grad_scaler_with_subnormal_init_scale_1e_40_is_invalid_scaler_config",
            run: || init_scale_refused(1e-40),
        },
        Case {
            name: "grad_scaler_with_init_scale_0_is_invalid_scaler_config",
            run: || init_scale_refused(0.0),
        },
        Case {
            name: "grad_scaler_with_nan_init_scale_is_invalid_scaler_config",
            run: || init_scale_refused(f64::NAN),
        },
        Case {
            name: "grad_scaler_with_init_scale_past_f32_is_invalid_scaler_config",
            run: || init_scale_refused(1e39),
        },
        Case {
            name: "grad_scaler_with_growth_factor_1_is_invalid_scaler_config",
            run: || {
                config_refused(GradScalerConfig {
                    growth_factor: 1.0,
                    ..GradScalerConfig::default()
                })
            },
        },
        Case {
            name: "grad_scaler_with_backoff_factor_0_is_invalid_scaler_config",
            run: || {
                config_refused(GradScalerConfig {
                    backoff_factor: 0.0,
                    ..GradScalerConfig::default()
                })
            },
        },
        Case {
            name: "grad_scaler_with_growth_interval_0_is_invalid_scaler_config",
            run: || {
                config_refused(GradScalerConfig {
                    growth_interval: 0,
                    ..GradScalerConfig::default()
                })
            },
        },
        Case {
            name: "update_to_0_is_invalid_scaler_config_and_keeps_the_scale",
            run: || {
                let (mut scaler, _, _) = scaled()?;
                let res = expect_err!(scaler.update_to(0.0), AmpError::InvalidScalerConfig { .. });
                res.and_then(|()| expect_eq(scaler.get_scale()?, 65536.0))
            },
        },
        Case {
            name: "update_to_a_subnormal_scale_is_invalid_scaler_config",
            run: || {
                let (mut scaler, _, _) = scaled()?;
                expect_err!(
                    scaler.update_to(1e-40),
                    AmpError::InvalidScalerConfig { .. }
                )
            },
        },
        Case {
            name: "update_to_before_any_scale_is_not_scaled",
            run: || {
                let mut scaler = GradScaler::new(GradScalerConfig::default())?;
                expect_err!(scaler.update_to(1024.0), AmpError::NotScaled)
            },
        },
        Case {
            name: "step_before_any_scale_is_not_scaled",
            run: || {
                let mut sgd = one_param_group(SgdConfig::new(0.1), Implementation::Fused)?;
                let mut scaler = GradScaler::new(GradScalerConfig::default())?;
                expect_err!(scaler.step(&mut sgd), AmpError::NotScaled)
            },
        },
        Case {
            name: "unscale_twice_is_already_unscaled",
            run: || {
                let (mut scaler, sgd, _) = scaled()?;
                scaler.unscale_(&sgd)?;
                expect_err!(scaler.unscale_(&sgd), AmpError::AlreadyUnscaled)
            },
        },
        Case {
            name: "unscale_after_step_is_unscale_after_step",
            run: || {
                let (mut scaler, mut sgd) = scaled_single()?;
                scaler.step(&mut sgd)?;
                expect_err!(scaler.unscale_(&sgd), AmpError::UnscaleAfterStep)
            },
        },
        Case {
            name: "step_twice_is_step_twice_and_updates_once",
            run: || {
                let (mut scaler, mut sgd, p) = scaled()?;
                scaler.step(&mut sgd)?;
                let res = expect_err!(scaler.step(&mut sgd), AmpError::StepTwice);
                // One SGD step of lr 0.1 on a gradient of ones.
                res.and_then(|()| expect_eq(p.to_vec::<f32>()?, vec![0.9; 4]))
            },
        },
        Case {
            name: "update_without_step_is_update_without_check",
            run: || {
                let (mut scaler, _, _) = scaled()?;
                expect_err!(scaler.update(), AmpError::UpdateWithoutCheck)
            },
        },
        Case {
            name: "load_state_with_growth_tracker_u32_max_is_invalid_scaler_config",
            run: || {
                let (mut scaler, _, _) = scaled()?;
                let state = scaler.state()?;
                let res = expect_err!(
                    scaler.load_state(headroom_amp::GradScalerState {
                        growth_tracker: u32::MAX,
                        ..state
                    }),
                    AmpError::InvalidScalerConfig { .. }
                );
                res.and_then(|()| expect_eq(scaler.state()?, state))
            },
        },
        Case {
            name: "load_state_with_scale_0_is_invalid_scaler_config",
            run: || {
                let (mut scaler, _, _) = scaled()?;
                let state = scaler.state()?;
                expect_err!(
                    scaler.load_state(headroom_amp::GradScalerState {
                        scale: 0.0,
                        ..state
                    }),
                    AmpError::InvalidScalerConfig { .. }
                )
            },
        },
        Case {
            name: "autocast_policy_in_f32_is_not_half",
            run: || {
                expect_err!(
                    AmpPolicy::torch_cuda(DType::F32),
                    AmpError::NotHalf {
                        dtype: DType::F32,
                        ..
                    }
                )
            },
        },
        Case {
            name: "autocast_override_of_an_unknown_op_is_unknown_op_naming_it",
            run: || {
                expect_err!(
                    AmpPolicy::torch_cuda(DType::BF16)?.with_override("conv9d", CastPolicy::Keep),
                    AmpError::UnknownOp { op } if op == "conv9d",
                    naming "conv9d"
                )
            },
        },
        Case {
            name: "master_weights_of_an_f32_parameter_is_parameter_dtype",
            run: || {
                let cpu = CpuBackend::new_ref();
                let half = Tensor::ones(&cpu, &[2], DType::BF16)?;
                let full = Tensor::ones(&cpu, &[2], DType::F32)?;
                let build = |masters: Vec<Tensor>| {
                    Sgd::new(
                        vec![ParamGroup::new(masters, SgdConfig::new(0.1))],
                        Implementation::Fused,
                    )
                };
                expect_err!(
                    MasterWeights::new(vec![half, full], build),
                    AmpError::ParameterDType {
                        index: 1,
                        got: DType::F32,
                        ..
                    }
                )
            },
        },
        Case {
            name: "opt_level_with_an_f32_half_dtype_is_not_half",
            run: || {
                expect_err!(
                    OptLevel::O2.properties(DType::F32),
                    AmpError::NotHalf {
                        dtype: DType::F32,
                        ..
                    }
                )
            },
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// headroom-hooks

fn hooks_cases() -> Vec<Case> {
    /// An InBackward over fused SGD of one parameter, with `config`.
    fn in_backward(config: InBackwardConfig) -> Result<(InBackward, Tensor), HooksError> {
        let cpu = CpuBackend::new_ref();
        let p = param(&cpu, &[1.0; 4])?;
        let sgd = Sgd::new(
            vec![ParamGroup::new(vec![p.clone()], SgdConfig::new(0.1))],
            Implementation::Fused,
        )?;
        Ok((InBackward::new(Box::new(sgd), config)?, p))
    }
    /// A loss scaler of another crate that opens its steps with `scale` (anything at all) and
    /// a one-element flag.
    #[derive(Debug)]
    struct OddScaler {
        scale: Tensor,
    }
    impl LossScaler for OddScaler {
        fn scale_loss(&mut self, loss: &Tensor) -> Result<Tensor, OptimError> {
            Ok(loss.clone())
        }
        fn begin_step(&mut self) -> Result<Option<DeviceGradScaling>, OptimError> {
            let found_inf = Tensor::zeros(self.scale.backend(), &[1], DType::F32)?;
            Ok(Some(DeviceGradScaling {
                grad_scale: Some(self.scale.clone()),
                found_inf: Some(found_inf),
            }))
        }
        fn end_step(&mut self, _: &DeviceGradScaling) -> Result<(), OptimError> {
            Ok(())
        }
    }
    fn exact_clipping() -> InBackwardConfig {
        InBackwardConfig {
            clipping: Some(Clipping {
                max_norm: 1.0,
                norm: NormType::L2,
                mode: ClipMode::Exact,
            }),
            ..InBackwardConfig::default()
        }
    }
    vec![
        Case {
            name: "backward_scaled_with_a_two_element_scale_is_invalid_argument",
            run: || {
                let (in_backward, p) = in_backward(InBackwardConfig::default())?;
                let scale = Tensor::full(p.backend(), &[2], 1024.0, DType::F32)?;
                let res = expect_err!(
                    in_backward.backward_scaled(&p.sum_all()?, &mut OddScaler { scale }),
                    HooksError::InvalidArgument {
                        op: "InBackward::backward_scaled",
                        ..
                    }
                );
                res.and_then(|()| expect_eq(p.to_vec::<f32>()?, vec![1.0; 4]))
            },
        },
        Case {
            name: "backward_scaled_with_an_f64_scale_is_invalid_argument",
            run: || {
                let (in_backward, p) = in_backward(InBackwardConfig::default())?;
                let scale = Tensor::full(p.backend(), &[1], 1024.0, DType::F64)?;
                expect_err!(
                    in_backward.backward_scaled(&p.sum_all()?, &mut OddScaler { scale }),
                    HooksError::InvalidArgument {
                        op: "InBackward::backward_scaled",
                        ..
                    }
                )
            },
        },
        Case {
            name: "backward_scaled_with_previous_step_clipping_is_invalid_argument",
            run: || {
                let (in_backward, p) = in_backward(InBackwardConfig {
                    clipping: Some(Clipping {
                        max_norm: 1.0,
                        norm: NormType::L2,
                        mode: ClipMode::PreviousStep,
                    }),
                    ..InBackwardConfig::default()
                })?;
                let mut scaler = GradScaler::new(GradScalerConfig::default())?;
                expect_err!(
                    in_backward.backward_scaled(&p.sum_all()?, &mut scaler),
                    HooksError::InvalidArgument { .. }
                )
            },
        },
        Case {
            name: "a_parameter_registered_twice_is_already_registered",
            run: || {
                let (_first, p) = in_backward(InBackwardConfig::default())?;
                let sgd = Sgd::new(
                    vec![ParamGroup::new(vec![p], SgdConfig::new(0.1))],
                    Implementation::Fused,
                )?;
                expect_err!(
                    InBackward::new(Box::new(sgd), InBackwardConfig::default()),
                    HooksError::AlreadyRegistered { index: 0 }
                )
            },
        },
        Case {
            // Stepping an InBackward by hand no longer compiles (it is not an Optimizer); a
            // scaler that is disabled makes a scaled backward a plain one.
            name: "backward_scaled_with_a_disabled_scaler_steps_unscaled",
            run: || {
                let (in_backward, p) = in_backward(InBackwardConfig::default())?;
                let mut scaler = GradScaler::new(GradScalerConfig {
                    enabled: false,
                    ..GradScalerConfig::default()
                })?;
                let skipped = in_backward.backward_scaled(&p.sum_all()?, &mut scaler)?;
                // One SGD step of lr 0.1 on a gradient of ones.
                expect_eq(skipped.read()?, false)
                    .and_then(|()| expect_eq(p.to_vec::<f32>()?, vec![0.9; 4]))
            },
        },
        Case {
            name: "in_backward_of_a_parameter_without_grad_is_does_not_require_grad",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = f32s(&cpu, &[1.0; 4], &[4])?;
                let sgd = Sgd::new(
                    vec![ParamGroup::new(vec![p], SgdConfig::new(0.1))],
                    Implementation::Fused,
                )?;
                expect_err!(
                    InBackward::new(Box::new(sgd), InBackwardConfig::default()),
                    HooksError::DoesNotRequireGrad { index: 0 }
                )
            },
        },
        Case {
            name: "in_backward_accumulating_0_micro_batches_is_invalid_argument",
            run: || {
                expect_err!(
                    in_backward(InBackwardConfig {
                        accumulation: 0,
                        ..InBackwardConfig::default()
                    }),
                    HooksError::InvalidArgument { .. }
                )
            },
        },
        Case {
            name: "in_backward_clipping_to_nan_is_invalid_argument",
            run: || {
                let mut config = exact_clipping();
                if let Some(clipping) = &mut config.clipping {
                    clipping.max_norm = f64::NAN;
                }
                expect_err!(in_backward(config), HooksError::InvalidArgument { .. })
            },
        },
        Case {
            name: "plain_backward_under_exact_clipping_is_needs_two_passes",
            run: || {
                let (_in_backward, p) = in_backward(exact_clipping())?;
                let err = match p.sum_all()?.backward() {
                    Ok(()) => return Err("expected NeedsTwoPasses, got Ok".into()),
                    Err(err) => err,
                };
                match err.hook_source::<HooksError>() {
                    Some(HooksError::NeedsTwoPasses) => expect_eq(p.to_vec::<f32>()?, vec![1.0; 4]),
                    _ => Err(format!("expected NeedsTwoPasses, got {err:?}").into()),
                }
            },
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// headroom-checkpoint

fn checkpoint_cases() -> Vec<Case> {
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
    fn blocks(n: usize) -> Vec<headroom_nn::BlockForward> {
        (0..n)
            .map(|_| -> headroom_nn::BlockForward { Arc::new(|x: &Tensor| Ok(x.tanh()?)) })
            .collect()
    }
    vec![
        Case {
            name: "int8_quantize_with_block_of_3_is_invalid_argument",
            run: || quantize_refused(12, 3, 12, 4),
        },
        Case {
            name: "int8_quantize_with_block_of_0_is_invalid_argument",
            run: || quantize_refused(12, 0, 12, 0),
        },
        Case {
            name: "int8_quantize_with_block_past_the_range_is_invalid_argument",
            run: || {
                let block = 2 * headroom_checkpoint::INT8_BLOCK_RANGE.end();
                quantize_refused(block, block, block, 1)
            },
        },
        Case {
            name: "int8_quantize_with_too_few_codes_is_invalid_argument",
            run: || quantize_refused(512, 256, 511, 2),
        },
        Case {
            name: "int8_dequantize_with_too_many_absmax_values_is_invalid_argument",
            run: || {
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
        },
        Case {
            name: "compression_with_block_of_3_is_invalid_argument",
            run: || {
                expect_err!(
                    Compression::Int8Blockwise { block: 3 }.check(),
                    CheckpointError::InvalidArgument { .. },
                    naming "block size 3"
                )
            },
        },
        Case {
            name: "checkpoint_sequential_in_0_segments_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = param(&cpu, &[0.5; 4])?;
                expect_err!(
                    checkpoint_sequential(&blocks(3), 0, &x, &CheckpointOptions::default()),
                    CheckpointError::InvalidArgument {
                        op: "checkpoint_sequential",
                        ..
                    }
                )
            },
        },
        Case {
            name: "checkpoint_sequential_in_more_segments_than_blocks_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let x = param(&cpu, &[0.5; 4])?;
                expect_err!(
                    checkpoint_sequential(&blocks(3), 4, &x, &CheckpointOptions::default()),
                    CheckpointError::InvalidArgument {
                        op: "checkpoint_sequential",
                        ..
                    }
                )
            },
        },
        Case {
            name: "a_checkpointed_region_writing_its_input_is_region_writes_input",
            run: || {
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
        },
        Case {
            name: "an_input_modified_after_a_checkpointed_forward_is_input_modified",
            run: || {
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
        },
        Case {
            name: "offloading_cpu_tensors_is_offload_needs_cuda",
            run: || {
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
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// headroom-distributed (the in-process group on the CPU backend)

/// Runs `f` on every rank of `ranks`, each on its own thread with its own backend.
fn on_ranks<T: Send>(
    ranks: Vec<InProcessComm>,
    f: impl Fn(&InProcessComm, &BackendRef) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|comm| {
                let f = &f;
                scope.spawn(move || f(&comm, &CpuBackend::new_ref()))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

/// The one rank of a group of one.
fn solo() -> Result<InProcessComm, DistributedError> {
    Ok(InProcessGroup::ranks(1)?.remove(0))
}

fn distributed_cases() -> Vec<Case> {
    fn all_ok(outcomes: Vec<Outcome>) -> Outcome {
        let failures: Vec<String> = outcomes
            .into_iter()
            .enumerate()
            .filter_map(|(rank, outcome)| outcome.err().map(|err| format!("rank {rank}: {err}")))
            .collect();
        if failures.is_empty() {
            Ok(())
        } else {
            Err(failures.join("; ").into())
        }
    }
    vec![
        Case {
            name: "group_of_0_ranks_is_invalid_argument",
            run: || {
                expect_err!(
                    InProcessGroup::ranks(0),
                    DistributedError::InvalidArgument { .. }
                )
            },
        },
        Case {
            name: "reduce_scatter_into_another_ranks_chunk_is_invalid_argument",
            run: || {
                // Each rank's output is the chunk of its input that belongs to the other rank:
                // it overlaps the input other than in NCCL's in-place layout.
                all_ok(on_ranks(InProcessGroup::ranks(2)?, |comm, cpu| {
                    let input = Tensor::ones(cpu, &[4], DType::F32)?;
                    let other = 1 - comm.rank();
                    let output = input.narrow(0, 2 * other, 2)?;
                    expect_err!(
                        comm.reduce_scatter(&input, &output, ReduceOp::Sum),
                        DistributedError::InvalidArgument { op: "reduce_scatter", .. },
                        naming "overlap"
                    )
                }))
            },
        },
        Case {
            name: "reduce_scatter_in_nccls_in_place_layout_sums_each_chunk",
            run: || {
                all_ok(on_ranks(InProcessGroup::ranks(2)?, |comm, cpu| {
                    let r = comm.rank() as f32;
                    let input = f32s(cpu, &[r, r + 1.0, 10.0 * r, 10.0 * r + 1.0], &[4])?;
                    let output = input.narrow(0, 2 * comm.rank(), 2)?;
                    comm.reduce_scatter(&input, &output, ReduceOp::Sum)?;
                    let expected = [vec![1.0, 3.0], vec![10.0, 12.0]][comm.rank()].clone();
                    expect_eq(output.to_vec::<f32>()?, expected)
                }))
            },
        },
        Case {
            name: "all_gather_from_a_partly_overlapping_input_is_invalid_argument",
            run: || {
                let comm = solo()?;
                let cpu = CpuBackend::new_ref();
                let whole = Tensor::zeros(&cpu, &[4], DType::F32)?;
                let (input, output) = (whole.narrow(0, 1, 3)?, whole.narrow(0, 0, 3)?);
                expect_err!(
                    comm.all_gather(&input, &output),
                    DistributedError::InvalidArgument {
                        op: "all_gather",
                        ..
                    }
                )
            },
        },
        Case {
            name: "reduce_scatter_of_sizes_that_do_not_divide_is_invalid_argument",
            run: || {
                let comm = solo()?;
                let cpu = CpuBackend::new_ref();
                let input = Tensor::zeros(&cpu, &[3], DType::F32)?;
                let output = Tensor::zeros(&cpu, &[2], DType::F32)?;
                expect_err!(
                    comm.reduce_scatter(&input, &output, ReduceOp::Sum),
                    DistributedError::InvalidArgument {
                        op: "reduce_scatter",
                        ..
                    }
                )
            },
        },
        Case {
            name: "broadcast_from_a_root_out_of_range_is_invalid_argument",
            run: || {
                let comm = solo()?;
                let cpu = CpuBackend::new_ref();
                let t = Tensor::zeros(&cpu, &[2], DType::F32)?;
                expect_err!(
                    comm.broadcast(&t, 1),
                    DistributedError::InvalidArgument { op: "broadcast", .. },
                    naming "root 1"
                )
            },
        },
        Case {
            name: "all_reduce_of_an_integer_tensor_is_invalid_argument",
            run: || {
                let comm = solo()?;
                let cpu = CpuBackend::new_ref();
                let t = Tensor::from_slice(&cpu, &[1i64, 2], &[2])?;
                expect_err!(
                    comm.all_reduce(&t, ReduceOp::Sum),
                    DistributedError::InvalidArgument {
                        op: "all_reduce",
                        ..
                    }
                )
            },
        },
        Case {
            name: "all_reduce_of_a_non_contiguous_tensor_is_invalid_argument",
            run: || {
                let comm = solo()?;
                let cpu = CpuBackend::new_ref();
                let t = Tensor::zeros(&cpu, &[2, 3], DType::F32)?.t()?;
                expect_err!(
                    comm.all_reduce(&t, ReduceOp::Sum),
                    DistributedError::InvalidArgument {
                        op: "all_reduce",
                        ..
                    }
                )
            },
        },
        Case {
            name: "ranks_reducing_different_sizes_is_mismatch",
            run: || {
                let outcomes = on_ranks(InProcessGroup::ranks(2)?, |comm, cpu| {
                    let t = Tensor::zeros(cpu, &[2 + comm.rank()], DType::F32)?;
                    expect_err!(
                        comm.all_reduce(&t, ReduceOp::Sum),
                        DistributedError::Mismatch { rank: 1, .. }
                    )
                });
                all_ok(outcomes)
            },
        },
        Case {
            name: "a_rank_that_never_arrives_is_timeout",
            run: || {
                let mut ranks = InProcessGroup::ranks_with_timeout(2, Duration::from_millis(50))?;
                let absent = ranks.pop();
                let res = expect_err!(
                    ranks[0].barrier(),
                    DistributedError::Timeout {
                        rank: 0,
                        call: 0,
                        ..
                    }
                );
                drop(absent);
                res
            },
        },
        Case {
            name: "sharded_adafactor_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0; 4])?;
                expect_err!(
                    ShardedOptimizer::new(
                        vec![ParamGroup::new(vec![p], AdafactorConfig::new())],
                        Implementation::Fused,
                        Arc::new(solo()?),
                        ShardConfig {
                            bucket_bytes: 1 << 20,
                            clipping: None
                        },
                    ),
                    DistributedError::InvalidArgument {
                        op: "ShardedOptimizer::new",
                        ..
                    }
                )
            },
        },
        Case {
            name: "sharded_clipping_to_a_negative_norm_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0; 4])?;
                expect_err!(
                    ShardedOptimizer::new(
                        vec![ParamGroup::new(vec![p], AdamConfig::adamw())],
                        Implementation::Fused,
                        Arc::new(solo()?),
                        ShardConfig {
                            bucket_bytes: 1 << 20,
                            clipping: Some(ShardClipping {
                                max_norm: -1.0,
                                norm: NormType::L2
                            })
                        },
                    ),
                    DistributedError::InvalidArgument {
                        op: "ShardedOptimizer::new",
                        ..
                    }
                )
            },
        },
        Case {
            name: "sharded_optimizer_into_in_backward_with_clipping_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0; 4])?;
                let sharded = ShardedOptimizer::new(
                    vec![ParamGroup::new(vec![p], SgdConfig::new(0.1))],
                    Implementation::Fused,
                    Arc::new(solo()?),
                    ShardConfig {
                        bucket_bytes: 1 << 20,
                        clipping: None,
                    },
                )?;
                expect_err!(
                    sharded.into_in_backward(InBackwardConfig {
                        clipping: Some(Clipping {
                            max_norm: 1.0,
                            norm: NormType::L2,
                            mode: ClipMode::Exact
                        }),
                        ..InBackwardConfig::default()
                    }),
                    DistributedError::InvalidArgument { .. }
                )
            },
        },
        Case {
            name: "group_of_usize_max_ranks_is_invalid_argument",
            run: || {
                expect_err!(
                    InProcessGroup::ranks(usize::MAX),
                    DistributedError::InvalidArgument {
                        op: "InProcessGroup::ranks",
                        ..
                    }
                )
            },
        },
        Case {
            name: "rendezvous_never_published_is_io_after_the_wait",
            run: || {
                let rendezvous = FileRendezvous::new(&temp_path("never_published"));
                expect_err!(
                    rendezvous.wait(Duration::from_millis(30)),
                    DistributedError::Io {
                        what: "waiting for",
                        ..
                    }
                )
            },
        },
        Case {
            name: "rendezvous_file_of_5_bytes_is_io_naming_its_length",
            run: || {
                let path = temp_path("short_rendezvous");
                std::fs::write(&path, b"hello")?;
                let res = FileRendezvous::new(&path).wait(Duration::from_millis(30));
                let _ = std::fs::remove_file(&path);
                expect_err!(res, DistributedError::Io { what: "reading", .. }, naming "5 bytes")
            },
        },
        Case {
            name: "rendezvous_published_into_a_missing_directory_is_io",
            run: || {
                let path = temp_path("no_such_dir").join("id");
                expect_err!(
                    FileRendezvous::new(&path).publish(&UniqueId::from_bytes(b"id")),
                    DistributedError::Io {
                        what: "writing",
                        ..
                    }
                )
            },
        },
        Case {
            name: "shard_layout_over_0_ranks_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0; 4])?;
                expect_err!(
                    ShardLayout::new(&[p], 0, 0),
                    DistributedError::InvalidArgument {
                        op: "ShardLayout::new",
                        ..
                    }
                )
            },
        },
        Case {
            name: "shard_layout_of_a_rank_outside_the_group_is_invalid_argument",
            run: || {
                let cpu = CpuBackend::new_ref();
                let p = param(&cpu, &[1.0; 4])?;
                expect_err!(
                    ShardLayout::new(&[p], 2, 2),
                    DistributedError::InvalidArgument {
                        op: "ShardLayout::new",
                        ..
                    }
                )
            },
        },
    ]
}

// ---------------------------------------------------------------------------------------------
// headroom-nn

/// A path in the temporary directory, unique to this process and `name`.
fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("headroom_misuse_{}_{name}", std::process::id()))
}

/// Saves `saved` to a file and loads it into `into`, removing the file.
fn load_through_file(saved: &Linear, into: &Linear, name: &str) -> Result<(), NnError> {
    let path = temp_path(name);
    save_file(saved, &path)?;
    let res = load_file(into, &path, "");
    let _ = std::fs::remove_file(&path);
    res
}

fn linear(in_features: usize, out_features: usize, bias: bool) -> Result<Linear, NnError> {
    let cpu = CpuBackend::new_ref();
    Linear::new(
        &cpu,
        in_features,
        out_features,
        bias,
        DType::F32,
        &Generator::new(0),
    )
}

fn tiny_gpt2() -> Result<Gpt2LMHeadModel, NnError> {
    let cpu = CpuBackend::new_ref();
    Gpt2LMHeadModel::new(
        &cpu,
        Gpt2Config::tiny(),
        DType::F32,
        &Arc::new(Generator::new(0)),
    )
}

fn nn_cases() -> Vec<Case> {
    fn token_ids_refused(ids: &[i64], shape: &[usize]) -> Outcome {
        let model = tiny_gpt2()?;
        let cpu = model.transformer.wte.weight.backend().clone();
        let ids = Tensor::from_slice(&cpu, ids, shape)?;
        expect_err!(
            model.forward(&ids),
            NnError::Tensor(TensorError::InvalidArgument { op: "gather", .. }),
            naming "out of bounds"
        )
    }
    vec![
        Case {
            name: "loading_weights_without_a_bias_is_missing_parameter_naming_it",
            run: || {
                expect_err!(
                    load_through_file(&linear(4, 2, false)?, &linear(4, 2, true)?, "nobias"),
                    NnError::MissingParameter { name } if name == "bias",
                    naming "bias"
                )
            },
        },
        Case {
            name: "loading_a_weight_of_another_shape_is_parameter_shape",
            run: || {
                expect_err!(
                    load_through_file(&linear(4, 2, true)?, &linear(4, 3, true)?, "shape"),
                    NnError::ParameterShape { name, expected, found }
                        if name == "weight" && expected == &[3, 4] && found == &[2, 4]
                )
            },
        },
        Case {
            name: "loading_weights_with_an_extra_tensor_is_unexpected_parameter",
            run: || {
                expect_err!(
                    load_through_file(&linear(4, 2, true)?, &linear(4, 2, false)?, "extra"),
                    NnError::UnexpectedParameter { name } if name == "bias"
                )
            },
        },
        Case {
            name: "loading_a_file_of_garbage_is_a_safetensors_error",
            run: || {
                let path = temp_path("garbage.safetensors");
                std::fs::write(&path, b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage")?;
                let res = load_file(&linear(4, 2, true)?, &path, "");
                let _ = std::fs::remove_file(&path);
                expect_err!(res, NnError::Safetensors(_))
            },
        },
        Case {
            name: "loading_a_missing_file_is_io_naming_the_path",
            run: || {
                let path = temp_path("does_not_exist.safetensors");
                expect_err!(
                    load_file(&linear(4, 2, true)?, &path, ""),
                    NnError::Io { .. },
                    naming "does_not_exist"
                )
            },
        },
        Case {
            name: "linear_on_an_input_of_another_width_is_shape_mismatch",
            run: || {
                let layer = linear(4, 2, true)?;
                let x = Tensor::ones(layer.weight.backend(), &[3, 5], DType::F32)?;
                expect_err!(
                    layer.forward(&x),
                    NnError::Tensor(TensorError::ShapeMismatch { .. })
                )
            },
        },
        Case {
            name: "vit_on_images_of_another_size_is_invalid_input",
            run: || {
                let cpu = CpuBackend::new_ref();
                let vit = VisionTransformer::new(
                    &cpu,
                    VitConfig::tiny(),
                    DType::F32,
                    &Arc::new(Generator::new(0)),
                )?;
                let images = Tensor::zeros(&cpu, &[1, 3, 48, 48], DType::F32)?;
                expect_err!(
                    vit.forward(&images),
                    NnError::InvalidInput { module: "VisionTransformer", .. },
                    naming "[1, 3, 48, 48]"
                )
            },
        },
        Case {
            name: "vit_whose_heads_do_not_divide_the_width_is_invalid_config",
            run: || {
                let cpu = CpuBackend::new_ref();
                expect_err!(
                    VisionTransformer::new(
                        &cpu,
                        VitConfig {
                            num_heads: 5,
                            ..VitConfig::tiny()
                        },
                        DType::F32,
                        &Arc::new(Generator::new(0)),
                    ),
                    NnError::InvalidConfig { .. }
                )
            },
        },
        Case {
            name: "vit_whose_patch_does_not_divide_the_image_is_invalid_config",
            run: || {
                let cpu = CpuBackend::new_ref();
                expect_err!(
                    VisionTransformer::new(
                        &cpu,
                        VitConfig {
                            patch_size: 7,
                            ..VitConfig::tiny()
                        },
                        DType::F32,
                        &Arc::new(Generator::new(0)),
                    ),
                    NnError::InvalidConfig { .. }
                )
            },
        },
        Case {
            name: "gpt2_with_a_token_id_at_the_vocabulary_size_is_invalid_argument",
            run: || token_ids_refused(&[1, 128], &[1, 2]),
        },
        Case {
            name: "gpt2_with_a_negative_token_id_is_invalid_argument",
            run: || token_ids_refused(&[1, -1], &[1, 2]),
        },
        Case {
            name: "gpt2_longer_than_its_positions_is_invalid_input",
            run: || {
                let model = tiny_gpt2()?;
                let ids = Tensor::from_slice(
                    model.transformer.wte.weight.backend(),
                    &[1i64; 65],
                    &[1, 65],
                )?;
                expect_err!(
                    model.forward(&ids),
                    NnError::InvalidInput { module: "Gpt2Model", .. },
                    naming "64 positions"
                )
            },
        },
        Case {
            name: "gpt2_on_float_token_ids_is_dtype_mismatch",
            run: || {
                let model = tiny_gpt2()?;
                let ids =
                    Tensor::ones(model.transformer.wte.weight.backend(), &[1, 2], DType::F32)?;
                expect_err!(
                    model.forward(&ids),
                    NnError::Tensor(TensorError::DtypeMismatch {
                        op: "embedding",
                        lhs: DType::I64,
                        rhs: DType::F32
                    })
                )
            },
        },
        Case {
            name: "gpt2_whose_heads_do_not_divide_the_width_is_invalid_config",
            run: || {
                let cpu = CpuBackend::new_ref();
                expect_err!(
                    Gpt2LMHeadModel::new(
                        &cpu,
                        Gpt2Config {
                            n_head: 0,
                            ..Gpt2Config::tiny()
                        },
                        DType::F32,
                        &Arc::new(Generator::new(0)),
                    ),
                    NnError::InvalidConfig { .. }
                )
            },
        },
        Case {
            name: "gpt2_loss_of_labels_of_another_shape_is_invalid_input",
            run: || {
                let model = tiny_gpt2()?;
                let cpu = model.transformer.wte.weight.backend().clone();
                let logits = Tensor::zeros(&cpu, &[1, 4, 128], DType::F32)?;
                let labels = Tensor::from_slice(&cpu, &[1i64, 2, 3], &[1, 3])?;
                expect_err!(
                    model.loss(&logits, &labels),
                    NnError::InvalidInput {
                        module: "Gpt2LMHeadModel",
                        ..
                    }
                )
            },
        },
    ]
}
