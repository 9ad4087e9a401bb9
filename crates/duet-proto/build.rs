//! Generates the Rust code of the duet gRPC protocol (`proto/duet/v1/*.proto`) with
//! tonic-prost-build, clients and servers both, and writes the encoded file descriptor set to
//! `$OUT_DIR/duet_v1_descriptor.bin` for server reflection.
//!
//! protoc comes from the `protoc-bin-vendored` crate, so no system protoc is needed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest_dir.join("../../proto");
    let protos = [
        proto_root.join("duet/v1/generate.proto"),
        proto_root.join("duet/v1/worker.proto"),
    ];
    for proto in &protos {
        println!("cargo:rerun-if-changed={}", proto.display());
    }
    println!("cargo:rerun-if-changed=build.rs");

    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded here; prost-build reads PROTOC from the
    // environment and there is no other way to hand it the path.
    unsafe { std::env::set_var("PROTOC", &protoc) };

    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let includes = [proto_root.clone(), protoc_bin_vendored::include_path()?];
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .file_descriptor_set_path(out_dir.join("duet_v1_descriptor.bin"))
        .compile_protos(&protos, &includes)?;
    Ok(())
}
