//! `headroom-launch`: starts the ranks of one data-parallel job on this host.
fn main() {}
