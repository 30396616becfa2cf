//! Workspace tasks (`cargo xtask <command>`).

fn main() {}
