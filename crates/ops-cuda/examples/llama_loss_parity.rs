//! Our side of the Llama loss parity with transformers (issue 30: "the 1B shape's loss equal to
//! transformers' f32 loss within 1e-6 relative from the same safetensors"): builds a
//! `LlamaForCausalLM` of a named config (default Llama-3.2-1B) in f32 on CUDA from a fixed seed,
//! TF32 off, writes it as a Hugging Face checkpoint directory (`config.json`, `model.safetensors`
//! with Hugging Face's names), writes fixed-seed token ids, computes the causal-LM loss with
//! labels = ids twice (the unfused `forward` + `loss`, and `model.forward` +
//! `loss_from_hidden`, the fused head and loss) and writes both losses as JSON.
//! `scripts/pytorch/llama_loss_parity.py DIR` then loads the directory into transformers'
//! `LlamaForCausalLM` and compares (`scripts/gpu-measure.sh llama-parity` runs both).
//!
//! `cargo run --release -p headroom-ops-cuda --features cuda --example llama_loss_parity -- DIR [MODEL [BATCH SEQ [SEED]]]`
//!
//! MODEL is a name of `LlamaConfig::named` (default `llama-3.2-1b`; `llama-tiny` runs in
//! seconds), BATCH × SEQ default 2 × 2048 (the tiny configs: 2 × 64), SEED 0. Writes into DIR:
//! `config.json`, `model.safetensors`, `input_ids.safetensors` (`input_ids` I64 [BATCH, SEQ] and
//! the rotary `inv_freq` F32, which the script checks transformers derived the same) and
//! `headroom_loss.json`, also printed on stdout. The 1B model is 4.9 GB in f32 on the device and
//! twice that in host memory while it is written. Without a CUDA device it prints the testkit
//! gate's notice.

use std::error::Error;
use std::path::PathBuf;

use headroom_autograd_core::{
    no_grad, BackendRef, DType, Generator, LinearCrossEntropyOptions, Tensor,
};
use headroom_nn::{LlamaConfig, LlamaForCausalLM};
use headroom_ops_cuda::CudaBackend;
use headroom_testkit::gpu::cuda_or_skip;
use headroom_testkit::inputs::Xorshift;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

const USAGE: &str = "usage: llama_loss_parity DIR [MODEL [BATCH SEQ [SEED]]]";

/// The command line: the directory, the config's name and the batch shape and seed.
struct Options {
    dir: PathBuf,
    model: String,
    config: LlamaConfig,
    batch: usize,
    seq: usize,
    seed: u64,
}

fn options() -> Result<Options, Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = PathBuf::from(args.first().ok_or(USAGE)?);
    let model = args
        .get(1)
        .map_or("llama-3.2-1b", String::as_str)
        .to_owned();
    let config =
        LlamaConfig::named(&model).ok_or_else(|| format!("unknown model {model}; {USAGE}"))?;
    let number = |index: usize| -> Result<Option<u64>, Box<dyn Error>> {
        Ok(args.get(index).map(|arg| arg.parse::<u64>()).transpose()?)
    };
    let batch = number(2)?.map_or(2, |n| n as usize);
    let seq = number(3)?.map_or(config.max_position_embeddings.min(2048), |n| n as usize);
    let seed = number(4)?.unwrap_or(0);
    if args.len() > 5 || batch == 0 || seq < 2 {
        return Err(USAGE.into());
    }
    Ok(Options {
        dir,
        model,
        config,
        batch,
        seq,
        seed,
    })
}

/// Writes the token ids and the rotary frequencies as `DIR/input_ids.safetensors`.
fn write_inputs(options: &Options, ids: &[i64], inv_freq: &[f32]) -> Result<(), Box<dyn Error>> {
    let id_bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
    let freq_bytes: Vec<u8> = inv_freq.iter().flat_map(|f| f.to_le_bytes()).collect();
    let tensors = [
        (
            "input_ids",
            TensorView::new(Dtype::I64, vec![options.batch, options.seq], &id_bytes)?,
        ),
        (
            "inv_freq",
            TensorView::new(Dtype::F32, vec![inv_freq.len()], &freq_bytes)?,
        ),
    ];
    let bytes = safetensors::serialize(tensors, &None)?;
    std::fs::write(options.dir.join("input_ids.safetensors"), bytes)?;
    Ok(())
}

/// A scalar loss tensor's value (f32, exactly as an f64).
fn scalar(loss: &Tensor) -> Result<f64, Box<dyn Error>> {
    Ok(loss.to_vec_f64()?[0])
}

fn main() -> Result<(), Box<dyn Error>> {
    let options = options()?;
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return Ok(());
    };
    // f32 products in f32, as transformers' side runs them (PyTorch's allow_tf32 = False).
    cuda.set_allow_tf32(false);
    let device = cuda
        .allocator()
        .with_storage(|storage| storage.device_name());
    let gpu: BackendRef = cuda;
    let config = options.config;
    let model = LlamaForCausalLM::new(&gpu, config, DType::F32, &Generator::new(options.seed))?;
    eprintln!(
        "llama_loss_parity: {} ({} parameters) built; writing {}",
        options.model,
        config.num_parameters(),
        options.dir.display()
    );
    model.save_hugging_face(&options.dir)?;
    let mut random = Xorshift::new(options.seed + 1);
    let ids: Vec<i64> = (0..options.batch * options.seq)
        .map(|_| random.next_below(config.vocab_size as u64) as i64)
        .collect();
    write_inputs(&options, &ids, model.model.rotary_emb.inv_freq())?;
    let ids = Tensor::from_slice(&gpu, &ids, &[options.batch, options.seq])?;
    let (loss_forward, loss_from_hidden) = {
        let _guard = no_grad();
        let logits = model.forward(&ids)?;
        let loss_forward = scalar(&model.loss(&logits, &ids)?)?;
        drop(logits);
        let hidden = model.model.forward(&ids)?;
        let fused = model.loss_from_hidden(&hidden, &ids, &LinearCrossEntropyOptions::default())?;
        (loss_forward, scalar(&fused)?)
    };
    let json = format!(
        "{{\"tool\": \"llama_loss_parity\", \"model\": \"{}\", \"num_parameters\": {}, \
         \"batch\": {}, \"seq\": {}, \"seed\": {}, \"dtype\": \"f32\", \"tf32\": false, \
         \"device\": \"{}\", \"loss_forward\": {:?}, \"loss_from_hidden\": {:?}}}",
        options.model,
        config.num_parameters(),
        options.batch,
        options.seq,
        options.seed,
        device.replace('"', "'"),
        loss_forward,
        loss_from_hidden
    );
    std::fs::write(options.dir.join("headroom_loss.json"), format!("{json}\n"))?;
    println!("{json}");
    Ok(())
}
