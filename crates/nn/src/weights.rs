//! Weights as safetensors, by PyTorch's parameter names.
//!
//! [`load_weights`] copies every parameter of a module from a safetensors archive (converting
//! the element type when the file's differs) and fails, naming the parameter, on a missing,
//! extra or mis-shaped tensor; a prefix selects one model out of a file that holds several
//! (`vit.param.` in the golden file). [`save_weights`] writes every parameter under its name.
//! [`read_tensor`] reads any named tensor (inputs, reference outputs) onto a backend. This module
//! sits on the `safetensors` crate and the [`Module`] walk; it knows no model.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use headroom_autograd_core::{no_grad, BackendRef, DType, Tensor};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::error::{NnError, Result};
use crate::module::Module;

fn dtype_from_file(name: &str, dtype: Dtype) -> Result<DType> {
    Ok(match dtype {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::U8 => DType::U8,
        Dtype::BOOL => DType::Bool,
        Dtype::F8_E4M3 => DType::F8E4M3,
        Dtype::F8_E5M2 => DType::F8E5M2,
        other => {
            return Err(NnError::UnsupportedDtype {
                name: name.to_owned(),
                dtype: format!("{other:?}"),
            })
        }
    })
}

fn dtype_to_file(dtype: DType) -> Dtype {
    match dtype {
        DType::F64 => Dtype::F64,
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::U8 => Dtype::U8,
        DType::Bool => Dtype::BOOL,
        DType::F8E4M3 => Dtype::F8_E4M3,
        DType::F8E5M2 => Dtype::F8_E5M2,
    }
}

fn tensor_from_view(backend: &BackendRef, name: &str, view: &TensorView<'_>) -> Result<Tensor> {
    let dtype = dtype_from_file(name, view.dtype())?;
    let res = Tensor::empty(backend, view.shape(), dtype)?;
    backend.write_host(res.buffer(), 0, view.data())?;
    Ok(res)
}

/// Reads the tensor `name` of `tensors` onto `backend`, in the file's dtype (no grad).
pub fn read_tensor(backend: &BackendRef, tensors: &SafeTensors<'_>, name: &str) -> Result<Tensor> {
    let view = tensors.tensor(name)?;
    tensor_from_view(backend, name, &view)
}

/// Copies every parameter of `module` from the tensors named `prefix + parameter name`,
/// converting dtypes. Tensors whose names start with `prefix` but name no parameter are an
/// [`NnError::UnexpectedParameter`]; a parameter without a tensor is an
/// [`NnError::MissingParameter`]; a shape that differs is an [`NnError::ParameterShape`].
/// Nothing is written unless every check passes.
pub fn load_weights(module: &dyn Module, tensors: &SafeTensors<'_>, prefix: &str) -> Result<()> {
    load_weights_renamed(module, tensors, &|name| {
        name.strip_prefix(prefix).map(str::to_owned)
    })
}

/// [`load_weights`] with the file's names mapped to parameter names by `rename`; a tensor for
/// which it returns `None` is not the module's (skipped). The same checks apply: every mapped
/// name must be a parameter, every parameter must be present, shapes must match.
pub fn load_weights_renamed(
    module: &dyn Module,
    tensors: &SafeTensors<'_>,
    rename: &dyn Fn(&str) -> Option<String>,
) -> Result<()> {
    let params = module.named_parameters();
    let known: HashSet<&str> = params.iter().map(|(name, _)| name.as_str()).collect();
    let mut by_parameter: HashMap<String, String> = HashMap::new();
    let mut unexpected: Vec<String> = Vec::new();
    for file_name in tensors.names() {
        let Some(name) = rename(file_name) else {
            continue;
        };
        if known.contains(name.as_str()) {
            by_parameter.insert(name, file_name.clone());
        } else {
            unexpected.push(name);
        }
    }
    unexpected.sort_unstable();
    if let Some(name) = unexpected.into_iter().next() {
        return Err(NnError::UnexpectedParameter { name });
    }
    let mut views = Vec::with_capacity(params.len());
    for (name, param) in &params {
        let Some(file_name) = by_parameter.get(name) else {
            return Err(NnError::MissingParameter { name: name.clone() });
        };
        let view = tensors.tensor(file_name)?;
        if view.shape() != param.shape() {
            return Err(NnError::ParameterShape {
                name: name.clone(),
                expected: param.shape().to_vec(),
                found: view.shape().to_vec(),
            });
        }
        dtype_from_file(name, view.dtype())?;
        views.push(view);
    }
    let _guard = no_grad();
    for ((name, param), view) in params.iter().zip(&views) {
        let source = tensor_from_view(param.backend(), name, view)?;
        param.copy_(&source)?;
    }
    Ok(())
}

/// Reads a safetensors file and loads `module`'s parameters from it (see [`load_weights`]).
pub fn load_file(module: &dyn Module, path: &Path, prefix: &str) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|source| NnError::Io {
        path: path.display().to_string(),
        source,
    })?;
    load_weights(module, &SafeTensors::deserialize(&bytes)?, prefix)
}

/// Every parameter of `module` as a safetensors archive, by name, in its own dtype.
pub fn save_weights(module: &dyn Module) -> Result<Vec<u8>> {
    let mut entries: Vec<(String, DType, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, param) in module.named_parameters() {
        let dense = param.detach().contiguous()?;
        let size = dense.dtype().size_in_bytes();
        let mut bytes = vec![0u8; dense.numel() * size];
        dense
            .backend()
            .read_host(dense.buffer(), dense.layout().offset() * size, &mut bytes)?;
        entries.push((name, dense.dtype(), dense.shape().to_vec(), bytes));
    }
    let views = entries
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            Ok((
                name.as_str(),
                TensorView::new(dtype_to_file(*dtype), shape.clone(), bytes)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(safetensors::serialize(views, &None)?)
}

/// Writes every parameter of `module` to a safetensors file (see [`save_weights`]).
pub fn save_file(module: &dyn Module, path: &Path) -> Result<()> {
    let bytes = save_weights(module)?;
    std::fs::write(path, bytes).map_err(|source| NnError::Io {
        path: path.display().to_string(),
        source,
    })
}
