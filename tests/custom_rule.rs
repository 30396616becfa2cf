//! The `custom_rule` example's check under `cargo test`: Lion as an `ElementwiseRule`, its
//! fused, foreach and single forms equal to a hand-written loop, bit for bit, in f32 and bf16.

#[path = "../examples/custom_rule/lion.rs"]
mod lion;

#[test]
fn lion_as_an_elementwise_rule_equals_the_hand_written_loop_bit_for_bit() {
    let cpu = headroom::ops_cpu::CpuBackend::new_ref();
    assert_eq!(lion::check(&cpu).unwrap(), 71_007);
}
