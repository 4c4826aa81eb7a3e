// Calls to the admin API. The admin key lives in this tab's sessionStorage only and goes
// out in the Authorization header, never in a URL.

const STORAGE_KEY = "loraplex.adminKey";

export const session = {
  get key() { return sessionStorage.getItem(STORAGE_KEY); },
  set(key) { sessionStorage.setItem(STORAGE_KEY, key); },
  clear() { sessionStorage.removeItem(STORAGE_KEY); },
};

let onUnauthorized = () => {};
export function setUnauthorizedHandler(fn) { onUnauthorized = fn; }

/** An error answered by the API: `message` is the server's error.message. */
export class ApiError extends Error {
  constructor(status, payload) {
    const error = payload && payload.error ? payload.error : null;
    super(error && error.message ? error.message : `The server answered HTTP ${status}`);
    this.status = status;
    this.param = error ? error.param : null;
    this.code = error ? error.code : null;
  }
}

function parse(text) {
  try { return text ? JSON.parse(text) : null; } catch { return null; }
}

/** fetch + JSON with the admin key; throws ApiError (or a network Error). */
export async function api(method, path, body, key = session.key) {
  const headers = { Authorization: `Bearer ${key}` };
  const init = { method, headers, cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    throw new Error(`Cannot reach the server (${err.message})`);
  }
  const data = parse(await response.text());
  if (!response.ok) {
    const error = new ApiError(response.status, data);
    if (response.status === 401 && key === session.key) onUnauthorized(error);
    throw error;
  }
  return data;
}

/** A multipart upload with progress (0..1), by XMLHttpRequest: fetch has no upload progress. */
export function upload(path, formData, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", path);
    xhr.setRequestHeader("Authorization", `Bearer ${session.key}`);
    xhr.upload.onprogress = (event) => {
      if (event.lengthComputable) onProgress(event.loaded / event.total);
    };
    xhr.onload = () => {
      const data = parse(xhr.responseText);
      if (xhr.status >= 200 && xhr.status < 300) resolve(data);
      else {
        const error = new ApiError(xhr.status, data);
        if (xhr.status === 401) onUnauthorized(error);
        reject(error);
      }
    };
    xhr.onerror = () => reject(new Error("The upload failed: the connection was closed"));
    xhr.send(formData);
  });
}
