//! The misuse suite over the public Rust APIs: every crate handed bad input — settings out of
//! range, shapes that do not fit, buffers of another allocator, calls out of order — answers
//! with its typed error (or a checked result), never a panic and never a silent wrong value.
//!
//! One table of named cases, each a closure returning its outcome, and one checker that runs
//! them all (each under `catch_unwind`: a panic is a failure), collects every failure and
//! panics once listing them. The cases come from one module per crate (autograd-core's in two:
//! its tensor ops and its graph); this file holds the table, the checks every module uses
//! ([`expect_err!`], [`expect_eq`]) and the tensors, optimizers and paths they build. Cases in
//! [`KNOWN_BUGS`] are bugs found by this suite and not fixed yet: they must fail (the checker
//! prints why), so fixing one fails this test until its name leaves the list. The C ABI's misuse suite is `crates/torch-allocator/tests/c_abi_misuse.rs`
//! (process-wide state, so its own binary); the Python one is in `crates/python`.
//!
//! Everything runs on the CPU backend, host memory or a simulated device: no GPU needed.

mod allocator;
mod amp;
mod autograd_graph;
mod autograd_ops;
mod checkpoint;
mod distributed;
mod hooks;
mod nn;
mod optim;

use std::error::Error;

use headroom_autograd_core::{BackendRef, DType, Tensor, TensorError};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::kernels::SgdConfig;
use headroom_optim::{Implementation, OptimError, ParamGroup, Sgd};
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
// The modules take the macro by path: `use crate::expect_err;`.
use expect_err;

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
        allocator::cases(),
        autograd_ops::cases(),
        autograd_graph::cases(),
        optim::cases(),
        amp::cases(),
        hooks::cases(),
        checkpoint::cases(),
        distributed::cases(),
        nn::cases(),
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

/// SGD of learning rate 0.1 in `implementation` over `params` (one group).
fn sgd_over(params: Vec<Tensor>, implementation: Implementation) -> Result<Sgd, OptimError> {
    Sgd::new(
        vec![ParamGroup::new(params, SgdConfig::new(0.1))],
        implementation,
    )
}

/// A path in the temporary directory, unique to this process and `name`.
fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("headroom_misuse_{}_{name}", std::process::id()))
}
