//! `Adam8bitMath::Bitsandbytes` on the GPU against bitsandbytes 0.50.2 itself, bit for bit:
//! `testdata/bnb_golden.safetensors` holds `bnb.optim.Adam8bit`'s parameters after each of five
//! steps and its final states (8-bit codes and absmax, or f32 states under `min_8bit_size`), made
//! on an H200. Every parameter, code, absmax and f32 state must be equal. Each test is
//! marked `#[ignore = "needs a CUDA device"]`: it runs with `--include-ignored`.
#![cfg(feature = "cuda")]

use std::collections::HashMap;

use headroom_ops_cuda::CudaBackend;
use headroom_optim::cuda::{Adam8bitMath, CudaAdam8bit, DeviceAdam8bitParam};
use headroom_optim::kernels::{n_blocks, MIN_8BIT_SIZE};
use headroom_optim::Adam8bitConfig;
use headroom_testkit::gpu::cuda_or_skip;
use safetensors::SafeTensors;

const PARAMS: [&str; 3] = ["small", "big", "big2d"];
const STEPS: u64 = 5;

fn load() -> HashMap<String, Vec<u8>> {
    let bytes = headroom_testkit::golden::testdata("bnb_golden.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| (name, view.data().to_vec()))
        .collect()
}

/// Positions where `a` and `b` differ, in elements of `width` bytes.
fn differing(a: &[u8], b: &[u8], width: usize) -> usize {
    assert_eq!(a.len(), b.len());
    a.chunks_exact(width)
        .zip(b.chunks_exact(width))
        .filter(|(x, y)| x != y)
        .count()
}

fn check(tag: &str, cfg: Adam8bitConfig) {
    let Some(backend) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let golden = load();
    let down = |address: u64, len: usize| {
        let mut got = vec![0u8; len];
        // SAFETY: every address passed is a live allocation of at least `len` bytes.
        unsafe { backend.download(address, &mut got) }.unwrap();
        got
    };
    // Per parameter: its buffers (param, state1, state2, absmax1, absmax2) and its length.
    let mut buffers = Vec::new();
    for p in PARAMS {
        let init = &golden[&format!("adam8.init.{p}")];
        let len = init.len() / 4;
        let (state_bytes, blocks) = if len < MIN_8BIT_SIZE {
            (len * 4, 1)
        } else {
            (len, n_blocks(len))
        };
        let up = |bytes: &[u8]| backend.upload(bytes).unwrap();
        buffers.push((
            [
                up(init),
                up(&vec![0u8; state_bytes]),
                up(&vec![0u8; state_bytes]),
                up(&vec![0u8; blocks * 4]),
                up(&vec![0u8; blocks * 4]),
            ],
            len,
        ));
    }
    // SAFETY: no buffers yet; each step names its own.
    let mut adam = unsafe { CudaAdam8bit::new(backend.clone(), &[]) }
        .unwrap()
        .with_math(Adam8bitMath::Bitsandbytes);
    let mut failures = Vec::new();
    for step in 1..=STEPS {
        let grads: Vec<_> = PARAMS
            .iter()
            .map(|p| {
                let name = format!("adam8.grad.{p}.{}", step - 1);
                backend.upload(&golden[&name]).unwrap()
            })
            .collect();
        let params: Vec<DeviceAdam8bitParam> = buffers
            .iter()
            .zip(&grads)
            .map(|((b, len), grad)| DeviceAdam8bitParam {
                param: b[0].address(),
                grad: grad.address(),
                state1: b[1].address(),
                state2: b[2].address(),
                absmax1: b[3].address(),
                absmax2: b[4].address(),
                len: *len,
            })
            .collect();
        // SAFETY: the buffers above hold what `DeviceAdam8bitParam` describes (f32 states of
        // `len` for the small parameter), live until the downloads below wait.
        unsafe { adam.step_buffers(&cfg, step, &params, (None, None)) }.unwrap();
        for (p, (b, len)) in PARAMS.iter().zip(&buffers) {
            let expected = &golden[&format!("{tag}.param.{p}.{}", step - 1)];
            let n = differing(&down(b[0].address(), len * 4), expected, 4);
            println!("{tag}: step {step}: {p}: {n} of {len} parameters differ");
            if n != 0 {
                failures.push(format!("step {step} {p}: {n} parameters"));
            }
        }
        for grad in grads {
            backend.allocator().free(grad).unwrap();
        }
    }
    for (p, (b, len)) in PARAMS.iter().zip(&buffers) {
        let keys: &[(&str, usize, usize)] = if *len < MIN_8BIT_SIZE {
            &[("state1", 1, 4), ("state2", 2, 4)]
        } else {
            &[
                ("state1", 1, 1),
                ("state2", 2, 1),
                ("absmax1", 3, 4),
                ("absmax2", 4, 4),
            ]
        };
        for &(key, index, width) in keys {
            let expected = &golden[&format!("{tag}.final.{p}.{key}")];
            let n = differing(&down(b[index].address(), expected.len()), expected, width);
            println!(
                "{tag}: final {p}.{key}: {n} of {} differ",
                expected.len() / width
            );
            if n != 0 {
                failures.push(format!("final {p}.{key}: {n}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{tag} against bitsandbytes: {failures:?}"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn bitsandbytes_arithmetic_equals_bitsandbytes_bit_for_bit() {
    check("adam8bit", Adam8bitConfig::adam());
}

#[test]
#[ignore = "needs a CUDA device"]
fn bitsandbytes_arithmetic_with_weight_decay_equals_bitsandbytes_bit_for_bit() {
    check(
        "adam8bit_wd",
        Adam8bitConfig {
            weight_decay: 0.01,
            ..Adam8bitConfig::adam()
        },
    );
}
