//! Compiles the kubelet's device plugin, pod-resources and DRA APIs from `proto/` with a pure-Rust protobuf
//! compiler (protox), so building needs nothing but cargo: no system `protoc`.

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
    // The kubelet's DRA APIs, in a folder of their own: the health API v1's package is `v1`, as the
    // pod-resources API's is, and each package becomes one file.
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("dra");
    std::fs::create_dir_all(&out)?;
    let descriptors = protox::compile(
        [
            "registration.proto",
            "plugin-v1.proto",
            "plugin-v1beta1.proto",
            "health-v1alpha1.proto",
        ],
        ["proto/dra"],
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .out_dir(&out)
        .compile_fds(descriptors)?;
    let health_v1 = out.join("health-v1");
    std::fs::create_dir_all(&health_v1)?;
    let descriptors = protox::compile(["health-v1.proto"], ["proto/dra"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .out_dir(&health_v1)
        .compile_fds(descriptors)?;
    Ok(())
}
