//! The loader's own thread: it runs each epoch it is told to and hands
//! over every batch once its data is on the device.

use pyo3::prelude::*;

/// What the producer is told.
pub(super) enum Command {
    /// Run `epoch` from batch `skip`, tagging its batches `generation`.
    Start {
        epoch: u64,
        skip: usize,
        generation: u64,
    },
}

/// What the producer hands over, tagged with its epoch's generation.
pub(super) enum Message {
    Batch(gpufeed::Batch<u8>),
    End,
    Failed(gpufeed::Error),
}

/// The producer thread and its two channels.
pub(super) struct Producer {
    pub(super) commands: std::sync::mpsc::Sender<Command>,
    /// Behind a mutex only so that the `Loader` is `Sync` (a `Receiver` is
    /// not); reached through `&mut`, never locked.
    pub(super) batches: std::sync::Mutex<std::sync::mpsc::Receiver<(u64, Message)>>,
    pub(super) thread: std::thread::JoinHandle<()>,
}

impl Producer {
    /// Starts the thread that owns `loader`: it runs each epoch it is
    /// told to, handing over every batch once its data is on the device
    /// (at most one finished batch waits in the channel besides the one
    /// being handed over; `prefetch` more are in flight in the loader).
    pub(super) fn start(mut loader: gpufeed::Loader<'static, u8>) -> PyResult<Producer> {
        use std::sync::mpsc::{channel, sync_channel, TryRecvError};
        let (commands, command_rx) = channel::<Command>();
        let (batch_tx, batches) = sync_channel::<(u64, Message)>(1);
        let thread = std::thread::Builder::new()
            .name("gpufeed-loader".into())
            .spawn(move || {
                let mut active: Option<u64> = None;
                loop {
                    let command = if active.is_some() {
                        match command_rx.try_recv() {
                            Ok(c) => Some(c),
                            Err(TryRecvError::Empty) => None,
                            Err(TryRecvError::Disconnected) => return,
                        }
                    } else {
                        match command_rx.recv() {
                            Ok(c) => Some(c),
                            Err(_) => return,
                        }
                    };
                    if let Some(Command::Start {
                        epoch,
                        skip,
                        generation,
                    }) = command
                    {
                        loader.start_epoch(epoch, skip);
                        active = Some(generation);
                    }
                    let Some(generation) = active else { continue };
                    let message = match gpufeed::block_on(futures::StreamExt::next(&mut loader)) {
                        Some(Ok(b)) => Message::Batch(b),
                        Some(Err(e)) => {
                            active = None;
                            Message::Failed(e)
                        }
                        None => {
                            active = None;
                            Message::End
                        }
                    };
                    if batch_tx.send((generation, message)).is_err() {
                        return; // the Python object is gone
                    }
                }
            })
            .map_err(|e| {
                crate::convert::InternalError::new_err(format!(
                    "cannot start the loader's thread: {e}"
                ))
            })?;
        Ok(Producer {
            commands,
            batches: std::sync::Mutex::new(batches),
            thread,
        })
    }

    /// Stops the thread (dropping its channels makes it return after the
    /// step it is in) and joins it.
    pub(super) fn stop(self) {
        let Producer {
            commands,
            batches,
            thread,
        } = self;
        drop(commands);
        drop(batches);
        let _ = thread.join();
    }
}
