//! A GPU that runs nothing and records what it is asked (tests only): what a step allocates,
//! uploads, launches, downloads and waits for, counted from the backend's own code path. Every
//! launch is checked against its kernel's signature in `kernels/*.cu` (the count and kind of
//! each argument) and its grid and block against CUDA's limits, since no GPU checks them here.
//! A copy on the load stream from page-locked memory reads its source until it completes, as
//! the copy engine does: a download into that memory before then panics.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use crate::CudaError;
use crate::gpu::{Arg, DevicePtr, Gemm, Gpu, Launch};
use crate::kernels::FILES;

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Alloc(usize),
    /// Page-locked host memory.
    AllocPinned(usize),
    Free,
    Upload(usize),
    Download(usize),
    Zero(usize),
    Launch(&'static str),
    Gemm(Gemm),
    Fp8Gemm(Gemm),
    /// A layer's KV blocks read off the backend's stream (their count).
    GatherDownload(usize),
    /// A copy of `usize` bytes queued on the load stream.
    LoadUpload(usize),
    /// The host waited for the load stream.
    SynchronizeLoads,
    Synchronize,
    BeginCapture,
    /// A capture ended, with the launches (kernels and products) it captured.
    EndCapture(usize),
    Replay,
}

pub struct RecordingGpu {
    events: Mutex<Vec<Event>>,
    /// The arguments of every launch, in order (read by [`Self::take_args`]).
    args: Mutex<Vec<(&'static str, Vec<Arg>)>>,
    next: Mutex<DevicePtr>,
    capturing: Mutex<bool>,
    /// Copies queued on the load stream that have not completed: they complete when the host
    /// waits for them, or when a test says so ([`Self::complete_loads`]).
    loads_pending: Mutex<bool>,
    compute_capability: (i32, i32),
    /// Addresses of the page-locked memory handed out and not dropped.
    pinned: Arc<Mutex<Vec<Range<usize>>>>,
    /// Page-locked sources of the copies queued on the load stream that have not completed.
    load_sources: Mutex<Vec<Range<usize>>>,
}

/// A Hopper (9.0).
impl Default for RecordingGpu {
    fn default() -> Self {
        Self::with_compute_capability((9, 0))
    }
}

/// The recording GPU's page-locked memory: known as such until it is dropped.
pub struct RecordedPinned {
    bytes: Vec<u8>,
    registry: Arc<Mutex<Vec<Range<usize>>>>,
}

impl AsRef<[u8]> for RecordedPinned {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl AsMut<[u8]> for RecordedPinned {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
}

impl Drop for RecordedPinned {
    fn drop(&mut self) {
        let mine = range_of(&self.bytes);
        self.registry.lock().unwrap().retain(|r| *r != mine);
    }
}

fn range_of(bytes: &[u8]) -> Range<usize> {
    let start = bytes.as_ptr() as usize;
    start..start + bytes.len()
}

fn overlap(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// A recorded graph.
pub struct Graph;

impl RecordingGpu {
    /// A GPU of compute capability `(major, minor)`.
    pub fn with_compute_capability(compute_capability: (i32, i32)) -> Self {
        Self {
            events: Mutex::default(),
            args: Mutex::default(),
            next: Mutex::default(),
            capturing: Mutex::default(),
            loads_pending: Mutex::default(),
            compute_capability,
            pinned: Arc::default(),
            load_sources: Mutex::default(),
        }
    }

    /// Events since the last call.
    pub fn take(&self) -> Vec<Event> {
        std::mem::take(&mut *self.events.lock().unwrap())
    }

    /// The arguments of each launch of `kernel` since the last call (other kernels' are kept).
    pub fn take_args(&self, kernel: &str) -> Vec<Vec<Arg>> {
        let mut args = self.args.lock().unwrap();
        let (taken, kept) = std::mem::take(&mut *args)
            .into_iter()
            .partition(|(k, _)| *k == kernel);
        *args = kept;
        taken.into_iter().map(|(_, a)| a).collect()
    }

    fn record(&self, e: Event) {
        self.events.lock().unwrap().push(e);
    }

    /// The copies queued on the load stream complete.
    pub fn complete_loads(&self) {
        *self.loads_pending.lock().unwrap() = false;
        self.load_sources.lock().unwrap().clear();
    }
}

impl Gpu for RecordingGpu {
    type Graph = Graph;
    type Pinned = RecordedPinned;

    fn alloc(&self, bytes: usize) -> Result<DevicePtr, CudaError> {
        assert!(
            !*self.capturing.lock().unwrap(),
            "an allocation under capture"
        );
        self.record(Event::Alloc(bytes));
        let mut next = self.next.lock().unwrap();
        let ptr = *next + 0x1_0000;
        *next = ptr + bytes.div_ceil(256) as u64 * 256;
        Ok(ptr)
    }

    fn free(&self, _: DevicePtr) {
        self.record(Event::Free);
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<RecordedPinned, CudaError> {
        self.record(Event::AllocPinned(bytes));
        let memory = vec![0; bytes];
        // The heap buffer stays where it is however the Vec moves.
        self.pinned.lock().unwrap().push(range_of(&memory));
        Ok(RecordedPinned {
            bytes: memory,
            registry: self.pinned.clone(),
        })
    }

    fn free_memory(&self) -> Result<usize, CudaError> {
        Ok(1 << 30)
    }

    fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    fn upload(&self, _: DevicePtr, src: &[u8]) -> Result<(), CudaError> {
        assert!(!*self.capturing.lock().unwrap(), "an upload under capture");
        self.record(Event::Upload(src.len()));
        Ok(())
    }

    fn download(&self, dst: &mut [u8], _: DevicePtr) -> Result<(), CudaError> {
        assert!(!*self.capturing.lock().unwrap(), "a download under capture");
        let written = range_of(dst);
        assert!(
            !self
                .load_sources
                .lock()
                .unwrap()
                .iter()
                .any(|r| overlap(r, &written)),
            "a download into page-locked memory a copy on the load stream still reads"
        );
        dst.fill(0);
        self.record(Event::Download(dst.len()));
        Ok(())
    }

    fn zero(&self, _: DevicePtr, bytes: usize) -> Result<(), CudaError> {
        self.record(Event::Zero(bytes));
        Ok(())
    }

    fn launch(&self, launch: &Launch<'_>) -> Result<(), CudaError> {
        let params = signature(launch.kernel);
        let kinds: Vec<&str> = launch.args.iter().map(kind).collect();
        assert_eq!(
            kinds, params,
            "{}: the arguments do not match the kernel's parameters",
            launch.kernel
        );
        let (x, y, z) = launch.grid;
        assert!(
            x >= 1 && y >= 1 && z >= 1 && y <= 65_535 && z <= 65_535,
            "{}: grid {:?}",
            launch.kernel,
            launch.grid
        );
        assert!(
            (1..=1024).contains(&launch.block),
            "{}: block {}",
            launch.kernel,
            launch.block
        );
        // What a block may opt into on sm_90 (the launching GPU raises the limit at load).
        assert!(
            launch.shared_bytes <= 227 * 1024,
            "{}: {} bytes of dynamic shared memory",
            launch.kernel,
            launch.shared_bytes
        );
        self.record(Event::Launch(launch.kernel));
        self.args
            .lock()
            .unwrap()
            .push((launch.kernel, launch.args.to_vec()));
        Ok(())
    }

    fn gemm(&self, gemm: &Gemm) -> Result<(), CudaError> {
        self.record(Event::Gemm(*gemm));
        Ok(())
    }

    fn fp8_gemm(&self, gemm: &Gemm) -> Result<(), CudaError> {
        assert!(
            self.fp8_products("a product").is_ok(),
            "an FP8 product on a GPU without FP8"
        );
        // cuBLASLt's FP8 kernels: 16-byte aligned operands, leading dimensions multiples of 16.
        assert!(
            gemm.k.is_multiple_of(16) && gemm.n.is_multiple_of(16) && gemm.ld_out == gemm.n,
            "{gemm:?}: dimensions cuBLASLt's FP8 GEMM does not take"
        );
        assert!(
            [gemm.w, gemm.x, gemm.out].iter().all(|p| p % 16 == 0),
            "{gemm:?}: an operand off a 16-byte boundary"
        );
        self.record(Event::Fp8Gemm(*gemm));
        Ok(())
    }

    fn fp8_products(&self, what: &str) -> Result<(), CudaError> {
        crate::fp8_weights::require_fp8(self.compute_capability, what)
    }

    fn gather_download(
        &self,
        _: DevicePtr,
        chunks: &[u32],
        _: usize,
        dst: &mut [u8],
    ) -> Result<(), CudaError> {
        dst.fill(0);
        self.record(Event::GatherDownload(chunks.len()));
        Ok(())
    }

    fn upload_on_load_stream(&self, _: DevicePtr, src: &[u8]) -> Result<(), CudaError> {
        assert!(!*self.capturing.lock().unwrap(), "a load under capture");
        *self.loads_pending.lock().unwrap() = true;
        let read = range_of(src);
        if self
            .pinned
            .lock()
            .unwrap()
            .iter()
            .any(|r| overlap(r, &read))
        {
            // Pageable memory is staged by the driver before the call returns; pinned is read
            // by the copy engine until the copy completes.
            self.load_sources.lock().unwrap().push(read);
        }
        self.record(Event::LoadUpload(src.len()));
        Ok(())
    }

    fn loads_done(&self) -> Result<bool, CudaError> {
        Ok(!*self.loads_pending.lock().unwrap())
    }

    fn synchronize_loads(&self) -> Result<(), CudaError> {
        self.complete_loads();
        self.record(Event::SynchronizeLoads);
        Ok(())
    }

    fn synchronize(&self) -> Result<(), CudaError> {
        assert!(
            !*self.capturing.lock().unwrap(),
            "a synchronization under capture"
        );
        self.record(Event::Synchronize);
        Ok(())
    }

    fn begin_capture(&self) -> Result<(), CudaError> {
        *self.capturing.lock().unwrap() = true;
        self.record(Event::BeginCapture);
        Ok(())
    }

    fn end_capture(&self) -> Result<Graph, CudaError> {
        *self.capturing.lock().unwrap() = false;
        let mut events = self.events.lock().unwrap();
        let start = events
            .iter()
            .rposition(|e| *e == Event::BeginCapture)
            .expect("a capture began");
        // The captured work belongs to the graph; the log keeps the bracket and its count.
        let captured = events
            .drain(start + 1..)
            .filter(|e| matches!(e, Event::Launch(_) | Event::Gemm(_) | Event::Fp8Gemm(_)))
            .count();
        events.push(Event::EndCapture(captured));
        Ok(Graph)
    }

    fn replay(&self, _: &Graph) -> Result<(), CudaError> {
        self.record(Event::Replay);
        Ok(())
    }
}

/// What kind of parameter an argument fills.
fn kind(a: &Arg) -> &'static str {
    match a {
        Arg::Ptr(_) => "pointer",
        Arg::I32(_) => "int",
        Arg::U32(_) => "unsigned",
        Arg::U64(_) => "unsigned long long",
        Arg::F32(_) => "float",
    }
}

/// The kinds of `kernel`'s parameters, read off its `extern "C" __global__` definition.
fn signature(kernel: &str) -> Vec<&'static str> {
    let head = format!(" {kernel}(");
    let (source, at) = FILES
        .iter()
        .find_map(|f| {
            let mut from = 0;
            while let Some(i) = f.source[from..].find("extern \"C\" __global__") {
                let start = from + i;
                let body = &f.source[start..];
                let end = body.find('{').unwrap_or(body.len());
                if let Some(j) = body[..end].find(&head) {
                    return Some((f.source, start + j + head.len()));
                }
                from = start + 1;
            }
            None
        })
        .unwrap_or_else(|| panic!("no kernel {kernel} in kernels/"));
    let params = &source[at..at + source[at..].find(')').expect("a parameter list")];
    params
        .split(',')
        .map(|p| {
            let p = p.trim();
            if p.contains('*') {
                "pointer"
            } else if p.contains("unsigned long long") {
                "unsigned long long"
            } else if p.starts_with("unsigned") {
                "unsigned"
            } else if p.starts_with("int") {
                "int"
            } else if p.starts_with("float") {
                "float"
            } else {
                panic!("{kernel}: a parameter of a kind the backend does not pass: {p}")
            }
        })
        .collect()
}
