//! Finds UCX (>= 1.13) with pkg-config, generates bindings to `<ucp/api/ucp.h>` with bindgen and
//! turns bindgen's `extern "C"` declarations into a table of function pointers filled at run time
//! (see `src/load.rs`) and one `unsafe fn` per C function that calls through it. Nothing is
//! linked: the library directory pkg-config names is passed to the crate as `KVX_UCX_SYS_LIBDIR`.

use std::env;
use std::error::Error;
use std::path::PathBuf;

use proc_macro2::{Literal, TokenStream};
use quote::quote;
use syn::{FnArg, ForeignItem, ForeignItemFn, Item, Pat};

fn main() -> Result<(), Box<dyn Error>> {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let ucx = pkg_config::Config::new().atleast_version("1.13").cargo_metadata(false).probe("ucx").map_err(
        |e| {
            format!(
                "kvx-ucx-sys needs UCX >= 1.13 found by pkg-config (Debian: `apt-get install -y \
                 libucx-dev pkg-config libclang-dev`, or scripts/install-ucx.sh): {e}"
            )
        },
    )?;
    let libdir = pkg_config::get_variable("ucx", "libdir")?;
    println!("cargo:rustc-env=KVX_UCX_SYS_LIBDIR={libdir}");

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
    let generated = dynamic(syn::parse_file(&bindings.to_string())?)?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    std::fs::write(out.join("bindings.rs"), prettyplease::unparse(&generated))?;
    Ok(())
}

/// `file` with every `extern "C"` block replaced by the `Functions` table (a field per function,
/// and `Functions::resolve`, which fills it from a symbol lookup) and a wrapper per function.
fn dynamic(file: syn::File) -> Result<syn::File, Box<dyn Error>> {
    let (mut items, mut functions) = (Vec::new(), Vec::new());
    for item in file.items {
        match item {
            Item::ForeignMod(block) => {
                for foreign in block.items {
                    match foreign {
                        ForeignItem::Fn(f) => functions.push(f),
                        other => {
                            return Err(format!("bindgen declared a foreign non-function: {other:?}").into());
                        }
                    }
                }
            }
            other => items.push(other),
        }
    }
    let (mut fields, mut resolved, mut wrappers) = (Vec::new(), Vec::new(), Vec::new());
    for f in &functions {
        let ForeignItemFn { sig, .. } = f;
        if let Some(variadic) = &sig.variadic {
            return Err(format!("{}: variadic C functions are not wrapped: {variadic:?}", sig.ident).into());
        }
        let (name, inputs, output) = (&sig.ident, &sig.inputs, &sig.output);
        let pointer = quote! { unsafe extern "C" fn(#inputs) #output };
        let symbol = Literal::c_string(&std::ffi::CString::new(name.to_string())?);
        let mut args = Vec::new();
        for input in inputs {
            match input {
                FnArg::Typed(arg) => match &*arg.pat {
                    Pat::Ident(ident) => args.push(ident.ident.clone()),
                    other => return Err(format!("{name}: unnamed parameter {other:?}").into()),
                },
                FnArg::Receiver(_) => return Err(format!("{name}: a receiver in a C declaration").into()),
            }
        }
        let doc = format!(
            " `{name}` of the UCX that [`load`](crate::load) opened.\n\n # Safety\n As for the C \
             function.\n\n # Panics\n When UCX cannot be loaded: call [`load`](crate::load) first to \
             get the reason as an error."
        );
        // The generated `unsafe` blocks: `resolve`'s caller vouches that the symbol is this
        // declaration's C function; a wrapper's caller upholds the C function's contract.
        fields.push(quote! { pub(crate) #name: #pointer, });
        resolved.push(quote! {
            #name: unsafe { std::mem::transmute::<*mut std::ffi::c_void, #pointer>(symbol(#symbol)?) },
        });
        wrappers.push(quote! {
            #[doc = #doc]
            pub unsafe fn #name(#inputs) #output {
                unsafe { (crate::load::functions().#name)(#(#args),*) }
            }
        });
    }
    let generated: TokenStream = quote! {
        /// Every bound C function, resolved in the loaded UCX.
        pub(crate) struct Functions {
            #(#fields)*
        }

        impl Functions {
            /// Fills the table with the addresses `symbol` returns (non-null, or an error).
            ///
            /// # Safety
            /// `symbol` must return the address of the named C function of a UCX whose API these
            /// bindings declare.
            pub(crate) unsafe fn resolve(
                mut symbol: impl FnMut(&'static std::ffi::CStr) -> Result<*mut std::ffi::c_void, crate::LoadError>,
            ) -> Result<Self, crate::LoadError> {
                Ok(Functions { #(#resolved)* })
            }
        }

        #(#wrappers)*
    };
    items.extend(syn::parse2::<syn::File>(generated)?.items);
    Ok(syn::File { shebang: None, attrs: file.attrs, items })
}
