//! Gives the library the SONAME of the real one, so that a client linked against `libnvidia-ml.so.1` (or
//! dlopen'ing it by that name from LD_LIBRARY_PATH) accepts it.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvidia-ml.so.1");
}
