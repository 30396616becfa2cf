//! The embedded PTX modules and their lazily loaded functions.
//!
//! Each `kernels/*.cu` file becomes one PTX module, compiled by `cargo xtask build-kernels` and
//! committed gzipped under `kernels/ptx/` (its 23 MiB of PTX take 4: every binary embeds it, and
//! the crate has to fit crates.io's 10 MB), inflated once on first use ([`ptx_text`]). A module is
//! loaded into the context the first time one of its kernels runs, and each function is looked up
//! once and cached by name. Kernels are named by family and dtype suffix ([`KernelName`],
//! [`float_suffix`]).
//!
//! This module is ground floor: it sits on cudarc and `error.rs`, and knows nothing of the
//! backend, of views or of what the kernels compute.

use std::collections::HashMap;
use std::io::Read;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use headroom_autograd_core::{DType, Result, TensorError};
use parking_lot::Mutex;

use crate::error::CudaError;

/// A kernel's name as (family, suffix), e.g. `("unary", "f32")` for `unary_f32`, or
/// `("copy_b4", "")`: a launch looks its function up by this pair without building a string.
pub(crate) type KernelName = (&'static str, &'static str);

/// The suffix of the kernels for float `dtype` (`f32`, `f64`, `f16`, `bf16`); other dtypes are
/// unsupported by `op`.
pub(crate) fn float_suffix(op: &'static str, dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => return Err(TensorError::UnsupportedDtype { op, dtype: other }),
    })
}

/// The PTX modules, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Module {
    /// `kernels/elementwise.cu`.
    Elementwise,
    /// `kernels/rows.cu`.
    Rows,
    /// `kernels/index.cu`.
    Index,
    /// `kernels/attention.cu`.
    Attention,
    /// `kernels/attention_tc.cu`.
    AttentionTc,
    /// `kernels/attention_tf32.cu`.
    AttentionTf32,
    /// `kernels/attention_wgmma_sm90a.cu` (sm_90a PTX: compute capability 9.0 only).
    AttentionWgmma,
    /// `kernels/attention_ws_sm90a.cu` (sm_90a PTX: compute capability 9.0 only).
    AttentionWs,
    /// `kernels/llama.cu`.
    Llama,
    /// `kernels/float8.cu`, or on a device of compute capability 8.9 and above
    /// `kernels/float8_sm89.cu` (the same kernels, fp8 conversions in hardware).
    Float8,
}

impl Module {
    pub(crate) fn ptx(self) -> &'static str {
        match self {
            Module::Elementwise => ptx_text(include_bytes!("../kernels/ptx/elementwise.ptx.gz")),
            Module::Rows => ptx_text(include_bytes!("../kernels/ptx/rows.ptx.gz")),
            Module::Index => ptx_text(include_bytes!("../kernels/ptx/index.ptx.gz")),
            Module::Attention => ptx_text(include_bytes!("../kernels/ptx/attention.ptx.gz")),
            Module::AttentionTc => ptx_text(include_bytes!("../kernels/ptx/attention_tc.ptx.gz")),
            Module::AttentionTf32 => {
                ptx_text(include_bytes!("../kernels/ptx/attention_tf32.ptx.gz"))
            }
            Module::AttentionWgmma => ptx_text(include_bytes!(
                "../kernels/ptx/attention_wgmma_sm90a.ptx.gz"
            )),
            Module::AttentionWs => {
                ptx_text(include_bytes!("../kernels/ptx/attention_ws_sm90a.ptx.gz"))
            }
            Module::Llama => ptx_text(include_bytes!("../kernels/ptx/llama.ptx.gz")),
            Module::Float8 => ptx_text(include_bytes!("../kernels/ptx/float8.ptx.gz")),
        }
    }

    /// The module's PTX for a device of `compute_capability` (major, minor): [`Module::ptx`],
    /// but the compute_89 build of the fp8 kernels where the device has fp8 conversions.
    pub(crate) fn ptx_for(self, compute_capability: (i32, i32)) -> &'static str {
        match self {
            Module::Float8 if compute_capability >= (8, 9) => {
                ptx_text(include_bytes!("../kernels/ptx/float8_sm89.ptx.gz"))
            }
            other => other.ptx(),
        }
    }
}

/// The PTX text of a module embedded gzipped (`include_bytes!` of a `kernels/ptx/*.ptx.gz` that
/// `cargo xtask build-kernels` wrote), inflated the first time it is asked for and kept for the
/// process. optim and checkpoint embed theirs the same way.
///
/// # Panics
/// If `gzipped` is not gzipped UTF-8 text: the committed PTX is checked by xtask's
/// `committed_ptx_matches_the_kernel_sources`, and every module is inflated by a test.
pub fn ptx_text(gzipped: &'static [u8]) -> &'static str {
    static TEXTS: Mutex<Vec<(usize, &'static str)>> = Mutex::new(Vec::new());
    let key = gzipped.as_ptr() as usize;
    let mut texts = TEXTS.lock();
    if let Some(&(_, text)) = texts.iter().find(|(at, _)| *at == key) {
        return text;
    }
    let mut text = String::new();
    flate2::read::GzDecoder::new(gzipped)
        .read_to_string(&mut text)
        .expect("embedded PTX is gzipped UTF-8 (cargo xtask build-kernels --check)");
    let text: &'static str = Box::leak(text.into_boxed_str());
    texts.push((key, text));
    text
}

/// Loaded modules and looked-up functions of one context.
#[derive(Debug, Default)]
pub(crate) struct KernelCache {
    modules: Mutex<HashMap<Module, Arc<CudaModule>>>,
    functions: Mutex<HashMap<KernelName, CudaFunction>>,
    /// Modules other crates brought (by their name), see `CudaBackend::load_kernel`.
    external: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// The dynamic shared memory each kernel has opted in to, beyond the default 48 KiB.
    shared_opt_in: Mutex<HashMap<KernelName, u32>>,
}

impl KernelCache {
    /// Whether kernel `name` has not yet opted in to `bytes` of dynamic shared memory.
    pub(crate) fn needs_shared_opt_in(&self, name: KernelName, bytes: u32) -> bool {
        self.shared_opt_in
            .lock()
            .get(&name)
            .is_none_or(|&done| done < bytes)
    }

    /// Records that kernel `name` opted in to `bytes` of dynamic shared memory.
    pub(crate) fn note_shared_opt_in(&self, name: KernelName, bytes: u32) {
        let mut opted = self.shared_opt_in.lock();
        let done = opted.entry(name).or_insert(0);
        *done = (*done).max(bytes);
    }

    /// The function `name` of another crate's PTX module `module`, loading it on first use.
    pub(crate) fn external_function(
        &self,
        context: &Arc<CudaContext>,
        module: &'static str,
        ptx: &'static str,
        name: &str,
    ) -> Result<CudaFunction, CudaError> {
        let kernel_error = |e: cudarc::driver::DriverError| CudaError::Kernel {
            kernel: format!("{module}::{name}"),
            reason: e.to_string(),
        };
        let loaded = {
            let mut modules = self.external.lock();
            match modules.get(module) {
                Some(loaded) => loaded.clone(),
                None => {
                    let loaded = context
                        .load_module(Ptx::from_src(ptx))
                        .map_err(kernel_error)?;
                    modules.insert(module, loaded.clone());
                    loaded
                }
            }
        };
        loaded.load_function(name).map_err(kernel_error)
    }

    /// The function `name` of `module`, loading the module on first use.
    pub(crate) fn function(
        &self,
        context: &Arc<CudaContext>,
        module: Module,
        name: KernelName,
    ) -> Result<CudaFunction, CudaError> {
        if let Some(function) = self.functions.lock().get(&name) {
            return Ok(function.clone());
        }
        let full_name = match name {
            (family, "") => family.to_owned(),
            (family, suffix) => format!("{family}_{suffix}"),
        };
        let loaded = {
            let mut modules = self.modules.lock();
            match modules.get(&module) {
                Some(loaded) => loaded.clone(),
                None => {
                    let failed = |e: cudarc::driver::DriverError| CudaError::Kernel {
                        kernel: full_name.clone(),
                        reason: e.to_string(),
                    };
                    let ptx = module.ptx_for(context.compute_capability().map_err(failed)?);
                    let loaded = context.load_module(Ptx::from_src(ptx)).map_err(failed)?;
                    modules.insert(module, loaded.clone());
                    loaded
                }
            }
        };
        let function = loaded
            .load_function(&full_name)
            .map_err(|e| CudaError::Kernel {
                kernel: full_name.clone(),
                reason: e.to_string(),
            })?;
        self.functions.lock().insert(name, function.clone());
        Ok(function)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every embedded module inflates to PTX text, each once: a second ask hands back the same
    /// text without inflating it again.
    #[test]
    fn every_module_inflates_to_ptx_once() {
        for module in [
            Module::Elementwise,
            Module::Rows,
            Module::Index,
            Module::Attention,
            Module::AttentionTc,
            Module::AttentionTf32,
            Module::AttentionWgmma,
            Module::AttentionWs,
            Module::Llama,
            Module::Float8,
        ] {
            for capability in [(8, 0), (9, 0)] {
                let text = module.ptx_for(capability);
                assert!(
                    text.starts_with("//") || text.contains(".version"),
                    "{module:?}"
                );
                assert!(text.contains(".entry"), "{module:?}");
                assert!(std::ptr::eq(text, module.ptx_for(capability)), "{module:?}");
            }
        }
    }
}
