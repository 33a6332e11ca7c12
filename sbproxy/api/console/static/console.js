// The sbproxy console's page script: no framework, no build step.
// Deployments: refresh states from the status route, send actions, follow their jobs.
// Job detail: follow the durable event stream (resuming after the last event rendered).
"use strict";

const TERMINAL = new Set(["succeeded", "failed", "cancelled", "parked"]);

function text(el, value) {
  if (el) el.textContent = value === null || value === undefined ? "" : String(value);
}

function when(ms) {
  return ms ? new Date(ms).toISOString().replace("T", " ").slice(0, 19) : "-";
}

// Follow one job's SSE stream; onJob gets each snapshot, onEvent each journal event and its
// sequence number (the SSE id: a step event's own "seq" field is the step's position).
// EventSource resends Last-Event-ID itself when it reconnects (a server restart included).
function followJob(jobId, { after, onJob, onEvent }) {
  let url = `/admin/model-host/jobs/${encodeURIComponent(jobId)}/stream`;
  if (after) url += `?after=${encodeURIComponent(after)}`;
  const source = new EventSource(url);
  source.onmessage = (message) => {
    const data = JSON.parse(message.data);
    if (data.type === "job") {
      onJob(data.job);
      if (TERMINAL.has(data.job.status)) source.close();
    } else {
      onEvent(data, message.lastEventId);
    }
  };
  return source;
}

function describe(job, steps) {
  const names = steps.map((s) => `${s.name}: ${s.status}`).join(", ");
  const error = job && job.error ? ` (${job.error.code})` : "";
  return `${job ? job.status : "queued"}${error}${names ? " · " + names : ""}`;
}

function showJob(row, jobId, jobUrl) {
  const box = row.querySelector(".job-live");
  box.hidden = false;
  box.dataset.jobId = jobId;
  box.innerHTML = "";
  const link = document.createElement("a");
  link.href = jobUrl;
  link.textContent = `job ${jobId}`;
  const status = document.createElement("span");
  status.className = "job-progress";
  status.dataset.field = "job-progress";
  box.append(link, " ", status);
  const steps = new Map();
  let job = null;
  followJob(jobId, {
    onJob: (snapshot) => {
      job = snapshot;
      box.dataset.status = job.status;
      text(status, describe(job, [...steps.values()]));
    },
    onEvent: (event) => {
      if (event.type === "step") steps.set(event.seq, event);
      if (event.type === "status" && job) job = { ...job, status: event.status };
      if (event.type === "progress") text(status, `${describe(job, [...steps.values()])} · ${JSON.stringify(event)}`);
      else text(status, describe(job, [...steps.values()]));
    },
  });
}

async function act(button) {
  const row = button.closest("[data-deployment]");
  button.disabled = true;
  try {
    const response = await fetch(`/admin/ui/actions/${button.dataset.action}`, {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-Sbproxy-Console": "1" },
      body: JSON.stringify({ deployment: row.dataset.deployment }),
      credentials: "same-origin",
    });
    const body = await response.json();
    if (!response.ok) {
      text(row.querySelector("[data-field=last_error]"), `${body.code}: ${body.error}`);
      return;
    }
    showJob(row, body.job_id, body.job_url);
  } finally {
    button.disabled = false;
  }
}

async function refreshDeployments() {
  try {
    const response = await fetch("/admin/model-host/status", { credentials: "same-origin" });
    if (!response.ok) return;
    const status = await response.json();
    for (const entry of status.deployments) {
      const row = document.querySelector(`tr[data-deployment="${CSS.escape(entry.deployment)}"]`);
      if (!row) continue;
      row.dataset.state = entry.state;
      for (const field of ["state", "generation", "active_requests", "queued_requests", "last_error"]) {
        const el = row.querySelector(`[data-field=${field}]`);
        if (el) text(el, entry[field]);
      }
    }
  } catch (error) {
    // The server may be restarting; the next tick tries again.
  }
}

function setUpDeployments() {
  for (const button of document.querySelectorAll("button[data-action]")) {
    button.addEventListener("click", () => act(button));
  }
  setInterval(refreshDeployments, 1000);
}

function setUpJob(section) {
  const steps = section.querySelector("table.steps tbody");
  const events = section.querySelector("ol.events");
  const field = (name) => section.querySelector(`[data-field=${name}]`);
  const setStatus = (value) => {
    section.dataset.status = value;
    const el = field("status");
    text(el, value);
    el.className = `status status-${value}`;
  };
  text(field("live"), "(live)");
  followJob(section.dataset.jobId, {
    after: section.dataset.lastSeq,
    onJob: (job) => {
      setStatus(job.status);
      text(field("attempt"), job.attempt);
      text(field("recoveries"), job.recoveries);
      text(field("progress"), job.progress ? JSON.stringify(job.progress) : "-");
      text(field("error"), job.error ? `${job.error.code}: ${job.error.message}` : "");
      text(field("ended"), when(job.ended_at_ms));
      if (TERMINAL.has(job.status)) text(field("live"), "");
    },
    onEvent: (event, id) => {
      section.dataset.lastSeq = id;
      const item = document.createElement("li");
      item.dataset.seq = id;
      item.textContent = `${id} ${when(event.at_ms)} ${event.type} ${JSON.stringify(event)}`;
      events.append(item);
      if (event.type === "status") setStatus(event.status);
      if (event.type === "progress") text(field("progress"), JSON.stringify(event));
      if (event.type === "step") {
        let row = steps.querySelector(`tr[data-step-seq="${event.seq}"]`);
        if (!row) {
          row = document.createElement("tr");
          row.dataset.stepSeq = event.seq;
          for (let i = 0; i < 7; i += 1) row.append(document.createElement("td"));
          steps.append(row);
        }
        const cells = row.children;
        row.dataset.status = event.status;
        text(cells[0], event.seq);
        text(cells[1], event.name);
        text(cells[2], event.status);
        if (event.status !== "running") text(cells[5], when(event.at_ms));
        else text(cells[4], when(event.at_ms));
        text(cells[6], event.error ? `${event.error.code}: ${event.error.message}` : "");
      }
    },
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const page = document.body.dataset.page;
  if (page === "deployments") setUpDeployments();
  const job = document.querySelector("section.job[data-job-id]");
  if (job && !TERMINAL.has(job.dataset.status)) setUpJob(job);
});
