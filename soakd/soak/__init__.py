"""The parts of a running soak, each in its own module with a small public interface:

- ``windows``: the open windows (requests, telemetry, probe intervals) and when they close;
- ``recorder``: a finished request into the load metrics, its window and the target's up state;
- ``driver``: the load loop (closed or open loop) over the workload;
- ``telemetry``: sampler snapshots into their windows and the store's sample queue;
- ``events``: events and findings into the store before the log;
- ``session``: the run in the store (resume, segments, baseline, verdict);
- ``pipeline``: a closed window of one target persisted, analysed, published;
- ``target_run``: one target's parts (client, metrics, windows, recorder, driver, pipeline, analysis):
  the same for the only target of a soak and for every target of an A/B run;
- ``quiesce`` and ``canary``: the idle probes and the output-consistency canary;
- ``exporter``: the analysis results as metric families;
- ``status``: ``/status``, readiness, the progress and summary lines.

``soakd.runtime`` builds them and owns start/stop order, signals and the scheduler.
"""
