//! Compiles the kubelet device plugin API and pod-resources API from `proto/` with a pure-Rust protobuf compiler (protox), so building
//! needs nothing but cargo: no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(["api.proto", "podresources.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
