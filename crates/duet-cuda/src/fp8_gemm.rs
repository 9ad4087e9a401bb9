//! cuBLASLt's FP8 GEMM on the backend's stream: the driver side of [`Gpu::fp8_gemm`]. A plan
//! (descriptor, layouts, the heuristic's algorithm) is made once per shape and kept, so a
//! decode step's products query no heuristic; the workspace is cuBLAS's (same stream, in order),
//! so the products can be captured in a graph.
//!
//! [`Gpu::fp8_gemm`]: crate::gpu::Gpu::fp8_gemm

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;

use crate::CudaError;
use crate::gpu::{DevicePtr, Gemm};

fn blas(e: lt::CublasError) -> CudaError {
    CudaError::Blas(format!("cuBLASLt: {e:?}"))
}

/// One shape's descriptor, layouts and algorithm.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    /// W, X, out.
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: made by `Fp8Blas::plan` (null where not made yet), destroyed once.
        unsafe {
            for l in self.layouts.into_iter().filter(|l| !l.is_null()) {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

pub struct Fp8Blas {
    handle: sys::cublasLtHandle_t,
    workspace: DevicePtr,
    workspace_bytes: usize,
    plans: Mutex<HashMap<(usize, usize, usize), Plan>>,
}

// SAFETY: the handle and the plans are used under the backend's lock, one call at a time; the
// plans' map has a lock of its own.
unsafe impl Send for Fp8Blas {}
unsafe impl Sync for Fp8Blas {}

impl Drop for Fp8Blas {
    fn drop(&mut self) {
        self.plans.lock().expect("plans lock").clear();
        // SAFETY: created in `new`, destroyed once, after its plans.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

impl Fp8Blas {
    /// A cuBLASLt handle using `workspace_bytes` at `workspace` (which must outlive it).
    pub fn new(workspace: DevicePtr, workspace_bytes: usize) -> Result<Self, CudaError> {
        Ok(Self {
            handle: lt::create_handle().map_err(blas)?,
            workspace,
            workspace_bytes,
            plans: Mutex::new(HashMap::new()),
        })
    }

    /// The plan of `rows × k` by `n × k`: column-major, out (`n × rows`) = Wᵀ·X with W read
    /// transposed (the "TN" layout cuBLASLt's FP8 kernels require), f32 out.
    fn plan(&self, g: &Gemm) -> Result<Plan, CudaError> {
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(blas)?;
        // Freed on drop, whatever was made when an error returns.
        let mut plan = Plan {
            desc,
            layouts: [std::ptr::null_mut(); 3],
            // SAFETY: plain data, set from the heuristic before use.
            algo: unsafe { std::mem::zeroed() },
        };
        let transpose: i32 = 1; // CUBLAS_OP_T
        let keep: i32 = 0; // CUBLAS_OP_N
        let e4m3 = sys::cudaDataType::CUDA_R_8F_E4M3;
        let f32 = sys::cudaDataType::CUDA_R_32F;
        for (slot, (ty, rows, cols, ld)) in plan.layouts.iter_mut().zip([
            (e4m3, g.k, g.n, g.k),
            (e4m3, g.k, g.rows, g.k),
            (f32, g.n, g.rows, g.n),
        ]) {
            *slot =
                lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64).map_err(blas)?;
        }
        // SAFETY: a descriptor just made; the attributes' values are i32 as cuBLASLt takes them.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&transpose as *const i32).cast(),
                4,
            )
            .map_err(blas)?;
            lt::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                (&keep as *const i32).cast(),
                4,
            )
            .map_err(blas)?;
        }
        let pref = lt::create_matmul_pref().map_err(blas)?;
        let bytes = self.workspace_bytes as u64;
        // SAFETY: the preference and the plan's descriptors are live; freed below / by Plan.
        let found = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&bytes as *const u64).cast(),
                8,
            );
            let found = set.and_then(|_| {
                lt::get_matmul_algo_heuristic(
                    self.handle,
                    plan.desc,
                    plan.layouts[0],
                    plan.layouts[1],
                    plan.layouts[2],
                    plan.layouts[2],
                    pref,
                )
            });
            let _ = lt::destroy_matmul_pref(pref);
            found
        };
        let found = found.map_err(|e| {
            CudaError::Blas(format!(
                "cuBLASLt has no FP8 GEMM for {} × {} by {} × {} ({e:?})",
                g.rows, g.k, g.n, g.k
            ))
        })?;
        plan.algo = found.algo;
        Ok(plan)
    }

    /// Queues `g` on `stream`.
    pub fn gemm(&self, g: &Gemm, stream: sys::cudaStream_t) -> Result<(), CudaError> {
        let mut plans = self.plans.lock().expect("plans lock");
        let plan = match plans.entry((g.rows, g.n, g.k)) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(self.plan(g)?),
        };
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the pointers cover n×k and rows×k E4M3 values and rows×n f32 (the backend's
        // buffers), the plan matches `g`'s shape, and the workspace outlives the handle.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                g.w as *const c_void,
                plan.layouts[0],
                g.x as *const c_void,
                plan.layouts[1],
                g.out as *const c_void,
                plan.layouts[2],
                g.out as *mut c_void,
                plan.layouts[2],
                &plan.algo,
                self.workspace as *mut c_void,
                self.workspace_bytes,
                stream,
            )
        }
        .map_err(blas)
    }
}
