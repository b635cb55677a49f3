//! Compiles the kubelet device plugin API and pod-resources API from `proto/` with a pure-Rust protobuf compiler (protox), so building
//! needs nothing but cargo: no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    // Relative relocations packed (RELR): the loader reads a few kilobytes at start instead of ~450 KB of
    // relocation entries, pages that would otherwise stay resident.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
        && std::env::var("CARGO_CFG_TARGET_ENV").as_deref() == Ok("gnu")
    {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
    let descriptors = protox::compile(["api.proto", "podresources.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
