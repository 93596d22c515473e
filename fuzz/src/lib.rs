//! The one piece the libFuzzer binaries share: the target function looked up once by name.

use std::sync::OnceLock;

/// Runs the kvx-fuzz target `name` on `data` (looked up on the first call).
pub fn run(name: &str, data: &[u8]) {
    static TARGET: OnceLock<fn(&[u8])> = OnceLock::new();
    let target = TARGET.get_or_init(|| match kvx_fuzz::targets().into_iter().find(|t| t.name == name) {
        Some(t) => t.run,
        None => panic!("kvx-fuzz has no target {name}"),
    });
    target(data);
}
