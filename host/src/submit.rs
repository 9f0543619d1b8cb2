//! Handing decode steps to MLX on a second host thread.
//!
//! Why: on a GPU a decode step is host-bound (BENCHMARKS.md, "Where the time of a step
//! goes"): the host first builds the step's lazy graph (our model code, ~1.3 µs per
//! operation), then MLX walks that graph and encodes its kernels inside `async_eval`
//! (~3 µs per operation), while the device needs less than either. Done on one thread the two
//! add up. With a [`SubmitThread`], MLX encodes step `n` on the second thread while this
//! thread builds step `n + 1`, so a step costs the longer of the two instead of their sum.
//!
//! How it stays safe: MLX's streams belong to the thread that made them, so both threads
//! must use one stream made with `mlx_stream_new_thread_unsafe`, set as this thread's default
//! for the duration ([`SharedStream`]). MLX does not lock such a stream; the protocol below
//! gives every graph exactly one evaluating thread:
//! * this thread only builds graphs (which reads the shapes and dtypes of the arrays the
//!   previous step produces, never their data) and reads a token back only after
//!   [`SubmitThread::wait_oldest`] says its graph was handed over;
//! * the second thread only calls `async_eval`, one graph after the other.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use anyhow::{anyhow, bail, Result};
use mlx_rs::Array;

/// When greedy decoding hands its steps to a [`SubmitThread`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubmitMode {
    /// When MLX's default device is a GPU: there a step is host-bound. On the CPU the
    /// device is the host, and a third busy thread only competes for its cores.
    Auto,
    /// Always (tests use it to run the two-thread path on the CPU).
    On,
    /// Never: one thread builds and encodes (for comparison, or as a way out).
    Off,
}

static MODE: AtomicU8 = AtomicU8::new(0);

/// Sets the [`SubmitMode`] for the rest of the process (`--submit-thread`).
pub fn set_mode(mode: SubmitMode) {
    MODE.store(mode as u8, Ordering::Relaxed);
}

/// Whether the next greedy decode uses a [`SubmitThread`].
pub fn use_for_next_decode() -> bool {
    match MODE.load(Ordering::Relaxed) {
        m if m == SubmitMode::On as u8 => true,
        m if m == SubmitMode::Off as u8 => false,
        _ => crate::kernels::default_device_is_gpu(),
    }
}

thread_local! {
    /// The thread-unsafe stream made for each device type on this thread, reused by every
    /// request (MLX never frees a stream, so one per request would leak).
    static SHARED_STREAMS: RefCell<Vec<(u32, SendableStream)>> = const { RefCell::new(Vec::new()) };
}

/// An MLX stream handle; the stream it names is the thread-unsafe kind, usable anywhere.
struct SendableStream(mlx_sys::mlx_stream);

/// While alive, this thread's default stream is a stream that another thread may evaluate
/// on. Dropping it restores the previous default.
pub struct SharedStream {
    previous: mlx_sys::mlx_stream,
}

impl SharedStream {
    /// Makes the shared stream of the default device this thread's default stream.
    pub fn enter() -> Result<Self> {
        // SAFETY: every handle is created and freed here or kept in SHARED_STREAMS for the
        // life of the thread; the calls only read and set MLX's per-thread defaults.
        unsafe {
            let mut device = mlx_sys::mlx_device_new();
            let mut kind = mlx_sys::mlx_device_type__MLX_CPU;
            if mlx_sys::mlx_get_default_device(&mut device) != 0
                || mlx_sys::mlx_device_get_type(&mut kind, device) != 0
            {
                mlx_sys::mlx_device_free(device);
                bail!("MLX could not report its default device");
            }
            let mut previous = mlx_sys::mlx_stream_new();
            if mlx_sys::mlx_get_default_stream(&mut previous, device) != 0 {
                mlx_sys::mlx_stream_free(previous);
                mlx_sys::mlx_device_free(device);
                bail!("MLX could not report its default stream");
            }
            let shared = SHARED_STREAMS.with(|streams| {
                let mut streams = streams.borrow_mut();
                if let Some((_, s)) = streams.iter().find(|(k, _)| *k == kind) {
                    return s.0;
                }
                let made = mlx_sys::mlx_stream_new_thread_unsafe(device);
                streams.push((kind, SendableStream(made)));
                made
            });
            mlx_sys::mlx_device_free(device);
            if shared.ctx.is_null() || mlx_sys::mlx_set_default_stream(shared) != 0 {
                mlx_sys::mlx_stream_free(previous);
                bail!("MLX could not make a stream shared between threads");
            }
            Ok(SharedStream { previous })
        }
    }
}

impl Drop for SharedStream {
    fn drop(&mut self) {
        // SAFETY: `previous` was filled by mlx_get_default_stream and is freed once, here.
        unsafe {
            mlx_sys::mlx_set_default_stream(self.previous);
            mlx_sys::mlx_stream_free(self.previous);
        }
    }
}

/// A thread that calls `async_eval` on the graphs it is given, in order. Use it inside a
/// [`SharedStream`], and read no array of a graph before [`SubmitThread::wait_oldest`]
/// has returned for it.
pub struct SubmitThread {
    graphs: Option<mpsc::Sender<Array>>,
    acks: mpsc::Receiver<std::result::Result<(), String>>,
    unacknowledged: usize,
    thread: Option<JoinHandle<()>>,
}

impl SubmitThread {
    pub fn start() -> Result<Self> {
        let (graphs, inbox) = mpsc::channel::<Array>();
        let (ack, acks) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("mlx-submit".into())
            .spawn(move || {
                for graph in inbox {
                    let done = mlx_rs::transforms::async_eval([&graph]).map_err(|e| e.to_string());
                    // The graph's arrays are released here, on this thread, after MLX has
                    // taken what it needs.
                    drop(graph);
                    if ack.send(done).is_err() {
                        break;
                    }
                }
            })?;
        Ok(SubmitThread {
            graphs: Some(graphs),
            acks,
            unacknowledged: 0,
            thread: Some(thread),
        })
    }

    /// Queues `graph` (its output array) for `async_eval` on the submit thread.
    pub fn submit(&mut self, graph: &Array) -> Result<()> {
        self.graphs
            .as_ref()
            .and_then(|sender| sender.send(graph.clone()).ok())
            .ok_or_else(|| anyhow!("the MLX submit thread has stopped"))?;
        self.unacknowledged += 1;
        Ok(())
    }

    /// Waits until the oldest graph not yet confirmed has been handed to MLX (reports its
    /// failure); only then may its arrays be read.
    pub fn wait_oldest(&mut self) -> Result<()> {
        if self.unacknowledged == 0 {
            bail!("no decode step is waiting to be handed to MLX");
        }
        let done = self
            .acks
            .recv()
            .map_err(|_| anyhow!("the MLX submit thread has stopped"))?;
        self.unacknowledged -= 1;
        done.map_err(|e| anyhow!("evaluating a decode step: {e}"))
    }
}

impl Drop for SubmitThread {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop once the queued graphs are submitted.
        self.graphs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
