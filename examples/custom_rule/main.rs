//! A rule of your own: Lion written as an `ElementwiseRule` (`lion.rs`), run by headroom-optim's
//! drivers — fused, foreach with bounded temporaries and single tensor — on the CPU, and checked
//! against a hand-written loop of the same update, bit for bit, for f32 and bf16 parameters.
//! See README.md.

mod lion;

use headroom::ops_cpu::CpuBackend;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cpu = CpuBackend::new_ref();
    let elements = lion::check(&cpu)?;
    println!(
        "Lion as an ElementwiseRule: fused, foreach and single agree with the hand-written loop \
         bit for bit on {elements} elements, four steps, f32 and bf16"
    );
    Ok(())
}
