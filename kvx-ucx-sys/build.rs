//! Finds UCX (>= 1.13) with pkg-config, links `-lucp -luct -lucs -lucm` and generates bindings to
//! `<ucp/api/ucp.h>` with bindgen.

use std::env;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let ucx = pkg_config::Config::new().atleast_version("1.13").probe("ucx").map_err(|e| {
        format!(
            "kvx-ucx-sys needs UCX >= 1.13 found by pkg-config (Debian: `apt-get install -y libucx-dev \
             pkg-config libclang-dev`, or scripts/install-ucx.sh): {e}"
        )
    })?;

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t|ucs_status_ptr_t|ucs_memory_type_t|ucs_thread_mode_t")
        .allowlist_var("UCP_.*|UCS_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_debug(true)
        .impl_debug(false)
        .layout_tests(true)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder.generate().map_err(|e| format!("bindgen over <ucp/api/ucp.h> failed: {e}"))?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    bindings.write_to_file(out.join("bindings.rs"))?;
    // Lets dependents (through `links = "ucp"`) see the UCX version they were built against.
    println!("cargo:version={}", ucx.version);
    Ok(())
}
